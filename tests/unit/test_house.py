"""The house's walls, read from the source with `ast` (nothing is imported):

- no import circle among the project's modules (recipes/, muon/, models/, scripts/,
  train.py); every `import` counts, one inside a function body too (a lazy import is still an
  edge, and a circle through it breaks as soon as the import moves to the top);
- imports go one way between the rooms docs/design.md draws:
  `muon/` and `models/` import nothing of the project but themselves (not recipes/, not each
  other); `recipes/config/` (the config: schema, checks, Hydra glue) imports, of recipes/,
  only config/ and leaf modules (ones that import nothing of the project, as
  `recipes/data_files.py`), so the config never reaches the harness it configures; the core of
  `recipes/` (the harness) does not import `recipes/bench/` (the measuring toolkit built on
  it); no library module (muon/, models/, recipes/) imports scripts/ or train.py, and no
  script imports another (each is a front over recipes/);
- the single-device model (`models/glm/model/`) imports neither `torch.distributed` nor
  `models.glm.infra` (in any form), and names no `DTensor`, `dist.*`, `to_local`, `redistribute`;
- no private member read across modules: `from a import _b`, an import of a private module
  (`torch._C`), `mod._b`, and `obj._b` where `_b` is not a member this module's own classes
  define (a method, a class attribute or a `self._b` assignment). Without types this
  approximates "an object of a class defined elsewhere": it flags every foreign name, and is
  blind only where a class of this module defines the same name. The first foreign private
  segment of an attribute chain is the finding (`torch._C._autograd.x`: `_C`). Namedtuple's
  `_replace` / `_asdict` / `_fields` and Hydra's `_target_` count as public API. Scanned: the
  project's modules and tests/. Where torch (or Hydra, OmegaConf, transformers) offers no
  public way, or a test compares a private member with its reference on purpose, the
  finding is in `ALLOWED` with its reason; every entry must still be found (no rot).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("recipes", "muon", "models", "scripts")
#: attributes with a leading underscore that are public API
PUBLIC = {"_replace", "_asdict", "_fields", "_make", "_field_defaults", "_target_"}

#: room -> the rooms it may import (besides leaf modules, for recipes.config)
ROOM_IMPORTS = {
    "muon": {"muon"},
    "models": {"models"},
    "recipes.config": {"recipes.config", "muon", "models"},
    "recipes": {"recipes", "recipes.config", "muon", "models"},
    "recipes.bench": {"recipes.bench", "recipes", "recipes.config", "muon", "models"},
    "scripts": {"recipes", "recipes.config", "recipes.bench", "muon", "models"},
    "train": {"recipes", "recipes.config", "muon", "models"},
}
#: (importer, imported) edges that break a room rule, with their reason
ALLOWED_EDGES: dict[tuple[str, str], str] = {}

_FOREACH = "torch's foreach ops (one launch for a list of tensors) have no public name"
_DISPATCH = "TorchDispatchMode, the op-level hook, is exported from this module only"
_PYTREE = "tree_leaves of torch's pytree: no public module in this torch"
_PROFILER = (
    "the profiler's memory events need torch._C's profiler entries: no public way to start "
    "it on one thread's allocations"
)
_TORCH_MUON = "torch.optim.Muon's own Newton-Schulz and lr rule, the reference compared with"
_TEST_HELPER = "a helper of another test module"

#: (file, private member) -> why it is read there
ALLOWED = {
    # torch (or another library) offers no public way
    ("muon/census.py", "_amp_foreach_non_finite_check_and_unscale_"): (
        "the one fused finite check over a list of tensors, as torch's GradScaler runs it"
    ),
    ("muon/guard.py", "_foreach_norm"): _FOREACH,
    ("muon/guard.py", "_foreach_mul_"): _FOREACH,
    ("muon/normuon.py", "_foreach_copy_"): _FOREACH,
    ("muon/phases.py", "_foreach_zero_"): _FOREACH,
    ("muon/update.py", "_foreach_lerp_"): _FOREACH,
    ("muon/update.py", "_foreach_lerp"): _FOREACH,
    ("muon/update.py", "_foreach_copy_"): _FOREACH,
    ("muon/update.py", "_foreach_mul_"): _FOREACH,
    ("muon/update.py", "_foreach_add_"): _FOREACH,
    ("muon/update.py", "_foreach_addcmul_"): _FOREACH,
    ("recipes/grads.py", "_foreach_mul_"): _FOREACH,
    ("models/glm/model/moe.py", "_grouped_mm"): "torch's grouped matmul has no public name",
    ("muon/mesh.py", "_StridedShard"): (
        "FSDP2 over a TP/EP-sharded dim places a DTensor so: the placement has no public name"
    ),
    ("tests/unit/test_muon_plan.py", "_StridedShard"): (
        "FSDP2 over a TP/EP-sharded dim places a DTensor so: the placement has no public name"
    ),
    ("muon/layout.py", "_local_tensor"): (
        "DTensor's local tensor without to_local's extra view (one per parameter per step): "
        "no public accessor"
    ),
    ("models/glm/infra/init.py", "_utils"): (
        "compute_local_shape_and_global_offset: where a DTensor's shard lies, torch's only"
    ),
    ("recipes/bench/probe.py", "_python_dispatch"): _DISPATCH,
    ("recipes/bench/probe_count.py", "_pytree"): _PYTREE,
    ("recipes/bench/probe.py", "_subclasses"): (
        "FakeTensor, what DTensor infers shapes with (passed through uncounted): torch's only"
    ),
    ("recipes/bench/probe_count.py", "_schema"): (
        "which arguments a dispatched op writes: an OpOverload's schema has no public accessor"
    ),
    ("recipes/config/compose.py", "_internal"): (
        "Hydra's own argument parser, to read train.py's command line as Hydra will"
    ),
    ("recipes/config/describe.py", "_get_node"): (
        "OmegaConf's child node with its metadata (type, Enum choices): no public accessor"
    ),
    ("recipes/sweep.py", "_internal"): "Hydra's basic sweeper, subclassed to check each job",
    ("recipes/dcp_safe.py", "_traverse"): (
        "DCP's state-dict traversal, to load a checkpoint whose keys are a subset: torch's only"
    ),
    ("recipes/dcp_safe.py", "_EmptyStateDictLoadPlanner"): (
        "DCP's planner that loads a checkpoint without a target state dict: torch's only"
    ),
    ("recipes/dcp_safe.py", "_load_state_dict"): (
        "DCP's load with a given planner and storage reader: torch's only"
    ),
    ("recipes/dcp_safe.py", "_get_metadata_path"): (
        "FileSystemReader's metadata path, overridden by its subclass here"
    ),
    ("recipes/memory.py", "_C"): _PROFILER,
    ("recipes/memory.py", "_run_on_profiler_start"): _PROFILER,
    ("recipes/memory.py", "_run_on_profiler_stop"): _PROFILER,
    ("recipes/build.py", "_internal"): (
        "torch's fake process group, the world of 512 ranks the planner builds plans in"
    ),
    ("recipes/world.py", "_exit"): "os._exit: leave a forked rank without the parent's atexit",
    ("recipes/world.py", "_forkserver"): (
        "multiprocessing's fork server, started once per process: no public handle"
    ),
    ("recipes/world.py", "_forkserver_alive_fd"): (
        "whether the fork server still runs: multiprocessing has no public check"
    ),
    ("tests/distributed/test_harness.py", "_exit"): "os._exit: a rank that dies at once",
    ("tests/unit/test_runlock.py", "_held"): (
        "the process's run lock is module state: the fixture isolates it between tests"
    ),
    ("tests/e2e/test_train_features.py", "_python_dispatch"): _DISPATCH,
    ("tests/live_bytes.py", "_python_dispatch"): _DISPATCH,
    ("tests/unit/test_muon_graph_ready.py", "_python_dispatch"): _DISPATCH,
    ("tests/unit/test_qk_clip.py", "_python_dispatch"): _DISPATCH,
    ("tests/unit/test_qk_clip.py", "_local_scalar_dense"): "the aten op of a host read, by name",
    ("tests/unit/test_checkpoint_verify.py", "_load_state_dict_from_keys"): (
        "DCP's load of named keys only: torch's only"
    ),
    ("tests/unit/test_memory.py", "_C"): _PROFILER,
    ("tests/gpu/test_memory_cuda.py", "_C"): _PROFILER,
    ("tests/gpu/test_cuda_paths.py", "_dynamo"): "torch._dynamo.reset and its counters",
    ("tests/unit/test_eager.py", "_torchdynamo_disable"): (
        "torch.compiler.disable marks a function only so"
    ),
    ("tests/unit/test_eager.py", "_torchdynamo_orig_callable"): (
        "torch.compiler.disable keeps the function it wraps only so"
    ),
    ("tests/unit/test_models_mla.py", "_attn_implementation"): (
        "transformers' attention implementation is set on the config only so"
    ),
    ("tests/unit/test_models_mla.py", "_experts_implementation"): (
        "transformers' experts implementation is set on the config only so"
    ),
    ("tests/property/muon_cases.py", "_muon"): _TORCH_MUON,
    ("tests/unit/test_newton_schulz.py", "_muon"): _TORCH_MUON,
    # a test compares a private member with its reference on purpose
    ("tests/unit/test_written_backwards.py", "_Combine"): (
        "the routed outputs' hand-written backward, compared bit for bit with autograd's"
    ),
}


def _modules() -> dict[str, Path]:
    """Every project module by dotted name (scripts/x.py: `scripts.x`, train.py: `train`)."""
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    out = {}
    for path in [*files, ROOT / "train.py"]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(name: str, modules: dict) -> str | None:
    """The project module `name` imports: itself, or its nearest enclosing module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, tree: ast.AST, modules: dict) -> set[str]:
    """The project modules `module` (parsed as `tree`) imports anywhere in its body: `from a
    import b` is a.b where that is a module, else a; scripts import each other by bare name."""
    package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
    local = module.startswith("scripts.")  # scripts/ is on a script's sys.path
    targets = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{up}.{base}" if base else up
            targets += [f"{base}.{a.name}" for a in node.names]
    out = set()
    for t in targets:
        if local and f"scripts.{t.split('.')[0]}" in modules:
            t = f"scripts.{t}"
        if (found := _resolve(t, modules)) is not None and found != module:
            out.add(found)
    return out


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """module -> the project modules it imports."""
    modules = _modules()
    return {
        m: frozenset(imports_of(m, ast.parse(p.read_text(), str(p)), modules))
        for m, p in modules.items()
    }


def find_cycle(graph: dict) -> list[str] | None:
    """One import circle of `graph` as a path (first == last), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        path, on_path, todo = [], set(), [(start, iter(sorted(graph[start])))]
        if start in done:
            continue
        path.append(start)
        on_path.add(start)
        while todo:
            node, children = todo[-1]
            child = next(children, None)
            if child is None:
                todo.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                return path[path.index(child) :] + [child]
            elif child not in done:
                todo.append((child, iter(sorted(graph.get(child, ())))))
                path.append(child)
                on_path.add(child)
    return None


def room(module: str) -> str:
    """The room of a module: muon, models, recipes.config, recipes.bench, recipes (the
    harness's core), scripts or train."""
    parts = module.split(".")
    if parts[0] == "recipes" and len(parts) > 1 and parts[1] in ("config", "bench"):
        return f"recipes.{parts[1]}"
    return parts[0]


def upward_imports(graph: dict) -> list[tuple[str, str]]:
    """(importer, imported) edges no room rule allows."""
    wrong = []
    for a, imported in graph.items():
        for b in imported:
            if room(b) in ROOM_IMPORTS[room(a)]:
                continue
            leaf = not graph[b]
            if room(a) == "recipes.config" and room(b) == "recipes" and leaf:
                continue
            wrong.append((a, b))
    return sorted(wrong)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__") and name not in PUBLIC


def _own_members(tree: ast.AST) -> set[str]:
    """Private names the module's classes define: methods, class attributes, `self._x = `."""
    own = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                own.add(node.name)
            elif isinstance(node, ast.Assign):
                own |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                own.add(node.attr)
    return own


def private_reads(tree: ast.AST) -> set[str]:
    """The private members of other modules (and of objects of their classes) `tree` reads."""
    own, found = _own_members(tree), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            modules += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            segments = [s for m in modules for s in m.split(".") if _private(s)]
            if segments:
                found.add(segments[0])
            elif isinstance(node, ast.ImportFrom):
                found |= {a.name for a in node.names if _private(a.name)}
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            inner = node.value  # the chain's first private segment is the finding
            while isinstance(inner, ast.Attribute) and not (
                _private(inner.attr) and inner.attr not in own
            ):
                inner = inner.value
            if not isinstance(inner, ast.Attribute):
                found.add(node.attr)
    return found


#: what the single-device model may not import or name: packages (and `dist`, torch.distributed's
#: usual name) by their dotted prefix, and DTensor's names
PARALLEL_PREFIXES = ("torch.distributed.", "models.glm.infra.", "dist.")
PARALLEL_NAMES = {"DTensor", "to_local", "redistribute"}


def parallel_uses(tree: ast.AST, package: str = "models.glm.model") -> set[str]:
    """What `tree` (of `package`) imports, names or spells (`hasattr(w, "to_local")`) of those."""
    found = set()
    for node in ast.walk(tree):
        named = []
        if isinstance(node, ast.Import):
            named = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            up = package.rsplit(".", node.level - 1)[0] if node.level else ""
            base = ".".join(filter(None, (up, node.module)))
            named = [base, *(f"{base}.{a.name}" for a in node.names), *(a.name for a in node.names)]
        elif isinstance(node, ast.Name | ast.Constant):
            named = [node.id if isinstance(node, ast.Name) else node.value]
        elif isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else ""
            named = [node.attr, f"{owner}.{node.attr}"]
        found |= {n for n in named if n in PARALLEL_NAMES or f"{n}.".startswith(PARALLEL_PREFIXES)}
    return found


def _scanned() -> list[Path]:
    return [*_modules().values(), *(ROOT / "tests").rglob("*.py")]


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 100 and graph["recipes.config.store"]  # the scan sees the tree
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_imports_go_one_way_between_rooms():
    wrong = [e for e in upward_imports(import_graph()) if e not in ALLOWED_EDGES]
    assert not wrong, "\n".join(f"{a} ({room(a)}) imports {b} ({room(b)})" for a, b in wrong)
    stale = set(ALLOWED_EDGES) - set(upward_imports(import_graph()))
    assert not stale, f"ALLOWED_EDGES lists edges no longer there: {sorted(stale)}"


def test_no_private_member_read_across_modules():
    found = set()
    for path in _scanned():
        rel = path.relative_to(ROOT).as_posix()
        found |= {(rel, name) for name in private_reads(ast.parse(path.read_text(), rel))}
    new = sorted(found - set(ALLOWED))
    assert not new, "private members read across modules (file, member):\n" + "\n".join(
        map(str, new)
    )
    stale = sorted(set(ALLOWED) - found)
    assert not stale, f"ALLOWED lists reads no longer there: {stale}"


def test_the_checks_find_what_they_look_for():
    """Each check above can fail: a lazy import closes a circle, a config module importing
    the harness is upward, and each form of private read is found (a module's own class
    members are not)."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"b"}}) is None
    modules = {"recipes.config.x": Path("recipes/config/x.py"), "recipes.trainer": Path("t")}
    lazy = ast.parse("def f():\n    from recipes.trainer import Trainer\n")
    assert imports_of("recipes.config.x", lazy, modules) == {"recipes.trainer"}
    graph = {"recipes.config.x": {"recipes.trainer"}, "recipes.trainer": {"muon.a"}}
    graph |= {"muon.a": set(), "models.m": {"muon.a"}}
    assert upward_imports(graph) == [
        ("models.m", "muon.a"),
        ("recipes.config.x", "recipes.trainer"),
    ]
    src = """
from a import _b
import torch._C._autograd
from torch.utils._pytree import tree_leaves
x = mod._c + torch._C._d.e
class Mine:
    def _own(self):
        self._state = 1
        return other._foreign, self._state._flag, self._own, p._replace(a=1)
"""
    found = {"_b", "_C", "_pytree", "_c", "_foreign", "_flag"}
    assert private_reads(ast.parse(src)) == found


def test_the_single_device_model_uses_nothing_parallel():
    files = sorted((ROOT / "models" / "glm" / "model").rglob("*.py"))
    found = sorted(f"{p}: {u}" for p in files for u in parallel_uses(ast.parse(p.read_text())))
    assert len(files) > 10 and not found, "the model uses the parallel world:\n" + "\n".join(found)
    src = """
import torch.distributed as dist
from torch import distributed
from torch.distributed.tensor import DTensor
from ..infra.local import local_tensor
x = w.to_local() if hasattr(w, "redistribute") else dist.get_rank()
"""
    t, i = "torch.distributed", "models.glm.infra.local"
    want = {t, f"{t}.tensor", f"{t}.tensor.DTensor", "DTensor", i, f"{i}.local_tensor", "dist"}
    want |= {"to_local", "redistribute", "dist.get_rank"}
    assert parallel_uses(ast.parse(src)) == want
    assert not parallel_uses(ast.parse("import torch\nfrom models.glm.model import moe"))
