"""What the surface tests share: a function's parameter names, and a call made from a given module's frame."""

import inspect


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def call_from(module_name: str, function, **kwargs):
    """Call `function(**kwargs)` from a frame whose module is `module_name`: what `warnings` attributes a warning
    issued with `stacklevel=2` to."""
    namespace = {"__name__": module_name}
    exec(compile("def call(function, **kwargs):\n    return function(**kwargs)\n", module_name, "exec"), namespace)
    return namespace["call"](function, **kwargs)
