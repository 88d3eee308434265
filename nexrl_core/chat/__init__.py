"""Chat: what rollouts sample from (`model`), the chat half of every holder that
tokenises locally (`holder`, `templates`), and tool calls read from raw text
(`toolcalls`)."""
