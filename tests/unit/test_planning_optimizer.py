"""The dry-run planner plans the recipe's own optimizer: `recipes.planning.build_optimizer` is
`recipes.build.build_optimizer` over the default config with the planner's knobs, so every
group hyperparameter (lr, AdamW lr, betas, eps, ...) is the one training would use."""

from omegaconf import OmegaConf

from models.glm import GLMForCausalLM, get_preset
from recipes import planning
from recipes.build import build_optimizer
from recipes.config import Config


def _groups(opt) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def test_the_planner_builds_the_recipes_optimizer():
    model = GLMForCausalLM(get_preset("tiny"))
    planned = planning.build_optimizer(model, "agrs", True, "adamw", "fp32", normuon=True)
    knobs = {"remainder_strategy": "agrs", "ns_dtype": "float32", "normuon": True}
    cfg = OmegaConf.merge(OmegaConf.structured(Config), {"optim": {**knobs, "muon_split": "off"}})
    recipe = build_optimizer(cfg.optim, model)
    assert _groups(planned) == _groups(recipe)
    o = cfg.optim  # what the planner used to leave at muon.Muon's own defaults
    for g in planned.param_groups:
        if g["algorithm"] == "muon":
            assert g["lr"] == o.lr and g["weight_decay"] == o.weight_decay
        else:
            assert (g["lr"], tuple(g["betas"]), g["eps"]) == (o.adamw_lr, tuple(o.betas), o.eps)


def test_the_planner_has_no_builder_of_its_own(monkeypatch):
    """One builder: a change to the recipe's (a new knob, another default) reaches the plans."""
    import recipes.build

    calls = []
    real = recipes.build.build_optimizer
    monkeypatch.setattr(
        recipes.build, "build_optimizer", lambda *a, **k: calls.append(k) or real(*a, **k)
    )
    planning.build_optimizer(GLMForCausalLM(get_preset("tiny")), "agrs", False, "adamw", "bf16")
    assert calls == [{"expert_aware": False}]
