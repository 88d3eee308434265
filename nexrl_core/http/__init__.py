"""HTTP: how every service NexRL runs starts and answers (`serving`), request bodies
described by hand (`openapi`), and what NexRL's services tell its holders beyond the public
API (`capabilities`)."""
