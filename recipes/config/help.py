"""`python train.py --help`: every key of the composed config with its value, allowed values
and one-line help (`recipes.config.describe.schema_lines`, the schema's one text renderer).

conf/train.yaml's Hydra help template calls the `schema_help` resolver, so the listing shows
the config the given overrides compose (`python train.py optim=adamw --help` shows AdamW's
values), not the dataclass defaults alone.
"""

from pathlib import Path

from omegaconf import DictConfig

from recipes.config.describe import schema_lines


def schema_help(*, _root_: DictConfig) -> str:
    """The OmegaConf resolver behind the help template: the composed config's keys."""
    # string.Template (Hydra's help rendering) treats "$" as a placeholder
    return "\n".join(schema_lines(_root_)).replace("$", "$$")


#: the config tree train.py composes
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def config_groups() -> str:
    """The resolver listing the user's config groups, `group: option, ...` (conf/<group>/*.yaml;
    Hydra's own list would also show the optimizer schemas that conf/optim/*.yaml extend)."""
    groups = sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")
    return "\n".join(
        f"{g.name}: {', '.join(sorted(f.stem for f in g.glob('*.yaml')))}" for g in groups
    )
