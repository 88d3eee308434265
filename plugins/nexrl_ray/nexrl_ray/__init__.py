"""nexrl-ray: the ``ray`` placer, which puts each worker group's ranks on a Ray cluster.

See `nexrl_ray.placer`; the options are `nexrl_ray.options.RayPlacerOptions`.
"""
