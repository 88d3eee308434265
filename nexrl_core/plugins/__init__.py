"""Plugin machinery: the hook specs a plugin implements (`hookspecs`), the spec records its
hooks return (`specs`), how plugins are found and loaded (`loading`), the registries a run
looks components up in by name (`registry`), and the core's own components (`builtin`)."""
