"""Where and how a model trains: the backend seam (`backend`), trainers (`trainer`,
`holder_trainer`, `self_hosted`) over service holders (`holders`, `holder_backend`,
`coalesce`) or transports (`transport`, `batch`), the algorithm interfaces (`algorithms`),
worker groups and where their ranks run (`worker_groups`, `placement`), and the trained
model as an output (`model_export`)."""
