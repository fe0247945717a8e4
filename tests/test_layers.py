"""The package's layers: every import points down.

`LAYERS` lists hf_alibi's groups of modules from the bottom up. An import between two groups must go to a lower
layer; two groups of one layer import neither each other. The graph is `tests/test_import_graph.py`'s (lazy and
type-only imports counted), so a function-level import up the stack fails here too.

Bottom to top: the foundation (standard-library helpers, the one error line of every command); `models/alibi`, which
ships with every checkpoint and imports nothing else of ours; conversion; the package root, serving and the
experiments' lowest sub-packages; then each experiments sub-package on those below it; the commands; the CLI.
The experiments' order follows their imports: a run's `training` (the runner) writes the results, cards and figures
of `reporting`, so reporting sits below training, and `retrieval` drives training and reporting both.
"""

from __future__ import annotations

from test_import_graph import import_graph

# Bottom first. A group is a module or a package (the package and everything under it).
LAYERS: list[list[str]] = [
    [  # foundation: imported by anything, import nothing of ours
        "hf_alibi._transformers_compat",
        "hf_alibi.atomic_files",
        "hf_alibi.command_errors",
        "hf_alibi.import_utils",
        "hf_alibi.native_flush",
    ],
    ["hf_alibi.models"],  # ships with checkpoints: relative imports within its folder only
    [
        "hf_alibi.conversion",
        "hf_alibi.route_inspection",  # `hf_alibi.attention_route`: asks the model's own planner, nothing above it
    ],
    [
        "hf_alibi",  # the package root: registration with the Auto classes, `hf_alibi.convert`
        "hf_alibi.serving",
        "hf_alibi.serving_loader",
        "hf_alibi.experiments",  # the package itself (its extra's check)
        "hf_alibi.experiments.data",
        "hf_alibi.experiments.length",
    ],
    ["hf_alibi.experiments.setup"],
    ["hf_alibi.experiments.reporting"],
    ["hf_alibi.experiments.training"],
    ["hf_alibi.experiments.retrieval"],
    ["hf_alibi.experiments.commands"],
    ["hf_alibi.cli"],
]
# Where serving and its loader sit together: one feature split over two modules, the server on its loader.
SAME_FEATURE = {("hf_alibi.serving", "hf_alibi.serving_loader")}


def group_of(module: str) -> str:
    """The longest group in `LAYERS` that is `module` or a package above it (`hf_alibi` only for the root itself)."""
    groups = [group for layer in LAYERS for group in layer]
    matches = [g for g in groups if module == g or (g != "hf_alibi" and module.startswith(g + "."))]
    if not matches:
        raise AssertionError(f"{module} is in no layer: add it (or its package) to LAYERS in tests/test_layers.py")
    return max(matches, key=len)


def layer_of(group: str) -> int:
    return next(index for index, layer in enumerate(LAYERS) if group in layer)


def violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, edges in sorted(graph.items()):
        source = group_of(module)
        for target_module in sorted(edges):
            target = group_of(target_module)
            if target == source or (source, target) in SAME_FEATURE:
                continue
            if layer_of(target) >= layer_of(source):
                found.append(f"{module} (layer {layer_of(source)}) imports {target_module} (layer {layer_of(target)})")
    return found


def test_every_module_has_a_layer():
    for module in import_graph():
        group_of(module)


def test_imports_point_down():
    found = violations(import_graph())
    assert found == [], "imports that do not point down a layer:\n" + "\n".join(found)


def test_experiments_layer_order():
    """The experiments' sub-packages, bottom up, as the docs' picture (docs/contributing.md) draws them."""
    order = [group for layer in LAYERS for group in layer if group.startswith("hf_alibi.experiments.")]
    assert order == [
        "hf_alibi.experiments.data",
        "hf_alibi.experiments.length",
        "hf_alibi.experiments.setup",
        "hf_alibi.experiments.reporting",
        "hf_alibi.experiments.training",
        "hf_alibi.experiments.retrieval",
        "hf_alibi.experiments.commands",
    ]


def test_nothing_below_the_commands_imports_them():
    graph = import_graph()
    importers = {
        module
        for module, edges in graph.items()
        if any(e.startswith("hf_alibi.experiments.commands") for e in edges)
        and not module.startswith("hf_alibi.experiments.commands")
    }
    assert importers == {"hf_alibi.cli"}


def test_the_check_catches_an_upward_import():
    graph = {"hf_alibi.experiments.data.corpus": {"hf_alibi.experiments.training.runner"}}
    assert violations(graph) == [
        "hf_alibi.experiments.data.corpus (layer 3) imports hf_alibi.experiments.training.runner (layer 6)"
    ]
    sideways = {"hf_alibi.experiments.data.corpus": {"hf_alibi.experiments.length.length_eval"}}
    assert len(violations(sideways)) == 1
