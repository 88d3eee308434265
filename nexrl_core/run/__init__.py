"""A run of ``nexrl train`` or ``nexrl eval``: the loop (`loop`), where prompts come from
(`tasks`, `data`, `data_files`), how agents run against the model (`completions`,
`llm_client`, `rollout`, `limits`, `seeding`), held-out runs (`validation`, `evaluation`),
what it reports (`metrics`, `sinks`), and what lets it resume (`checkpoints`, `state`,
`interrupts`)."""
