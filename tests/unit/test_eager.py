"""The functions that stay eager under torch.compile are disabled for dynamo only once a layer
compiles, and importing the models does not import torch._dynamo (about 0.7 s per process)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_models_leaves_dynamo_unimported():
    code = "import sys, models.glm, recipes.config; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_compiling_a_layer_disables_every_eager_function_for_dynamo():
    from models.glm import GLMForCausalLM, get_preset
    from models.glm.model import execution

    model = GLMForCausalLM(get_preset("tiny"))
    model.model.layers[0].compile_block()  # torch.compile is lazy: nothing traces here
    assert execution.marked(), "models.glm marks its eager functions"
    for fn, now in execution.marked():
        assert now is not fn and now._torchdynamo_disable, fn.__qualname__
        assert now._torchdynamo_orig_callable is fn
