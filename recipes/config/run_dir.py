"""The run directory's name: which keys it leaves out, and its leaf for a set of overrides.

conf/train.yaml's `hydra.job.config.override_dirname.exclude_keys` resolves to `same_run_keys()`
and its run directory ends in `run_id(override_dirname)`, both resolvers registered by
`store.register`.
"""

import dataclasses

from recipes.config.schema import OPTIM_SCHEMAS, Config

#: config groups whose choice never changes what is trained (an experiment names its own run.name)
SAME_RUN_GROUPS = ("experiment", "logger", "checkpoint")


def same_run_keys() -> list[str]:
    """The keys (and groups) left out of the run directory's name: `SAME_RUN_GROUPS` and every
    field declared `same_run` (conf/train.yaml's `exclude_keys` resolves to this list)."""
    keys = list(SAME_RUN_GROUPS)

    def walk(node: type, prefix: str) -> None:
        for f in dataclasses.fields(node):
            if dataclasses.is_dataclass(f.default_factory):
                walk(f.default_factory, f"{prefix}{f.name}.")
            elif f.metadata["same_run"] and f"{prefix}{f.name}" not in keys:
                keys.append(f"{prefix}{f.name}")

    walk(Config, "")
    for schema in OPTIM_SCHEMAS.values():
        walk(schema, "optim.")
    return keys


RUN_ID_MAX = 200  # bytes of a run-dir leaf (file systems allow 255 per name)


def run_id(override_dirname: str) -> str:
    """The run-dir leaf for a set of overrides: stable for the same command, never empty. A
    longer one (paths in `model.path` / `checkpoint.init_from`) keeps its start and ends in a
    hash of the whole, so the same command still finds its run directory."""
    import hashlib

    leaf = override_dirname.replace("/", "_") or "base"
    if len(leaf.encode()) <= RUN_ID_MAX:
        return leaf
    digest = hashlib.sha1(leaf.encode()).hexdigest()[:16]
    return leaf.encode()[: RUN_ID_MAX - 17].decode(errors="ignore") + "-" + digest
