"""The Muon step captured in a CUDA graph (the local path and the AdamW groups, on one device)
and replayed gives the eager result, as microsoft/dion's CudaGraphOptimizer captures its step.

What is captured is `Muon.update` (the step after the gradient census, whose one host read
decides whether to skip): warmed up on a side stream, captured once with `torch.cuda.graph`,
then replayed on new gradients copied into the same gradient buffers. The same optimizer built
twice from the same seed runs eagerly beside it. Skipped where no CUDA device is present; run
by `scripts/gpu_check.sh --only graph`."""

import pytest
import torch

from tests.unit.test_muon_graph_ready import fill_grads, graph_optimizer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("gram", [False, True])
def test_captured_update_replays_the_eager_step(gram):
    """With `gram`, a Gram Newton-Schulz block and its output check are captured too."""
    device = torch.device("cuda", 0)
    graphed, gp = graph_optimizer(device, gram=gram)
    eager, ep = graph_optimizer(device, gram=gram)
    assert {b.path for _, batches in graphed.plans for b in batches} == {"local"}
    for step in range(2):  # warm up both (the census once, state moved in place)
        for opt, params in ((graphed, gp), (eager, ep)):
            fill_grads(params, step)
            opt.step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture wants a warm-up on a side stream (torch.cuda.graphs)
        for opt, params in ((graphed, gp), (eager, ep)):
            fill_grads(params, 2)
            opt.update(timed=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records the step; nothing is applied until a replay
        graphed.update(timed=False)
    for step in range(3, 6):
        fill_grads(gp, step)
        graph.replay()
        fill_grads(ep, step)
        eager.update(timed=False)
    torch.cuda.synchronize()
    # the same kernels on the same inputs; float32 Newton-Schulz, so a different cuBLAS choice
    # inside the graph could move a value by a few float32 ulps of the update (lr 0.02 times
    # entries of at most ~1), far below 1e-5
    for p, q in zip(gp, ep, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
        for key, value in graphed.state[p].items():
            torch.testing.assert_close(value, eager.state[q][key], rtol=1e-5, atol=1e-6)
    # and the replays did step: the parameters moved from the warm-up state
    assert graphed.state[gp[-1]]["step"].item() == 6
