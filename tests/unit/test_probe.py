"""recipes.bench.probe: which reads of which tensors would sync a GPU, counted on CPU."""

import torch

from recipes.bench.probe import DeviceProbe, all_on_device
from recipes.bench.probe_report import ops_sites_table


def _counted(fn, *device_tensors):
    probe = DeviceProbe()
    probe.mark(*device_tensors)
    with probe.tracking(), probe.region("r") as count:
        fn(probe)
    return count


def test_reads_of_device_tensors_are_syncs_with_their_site():
    w = torch.randn(4, 4)

    def step(probe):
        y = w @ w
        y.sum().item()
        bool(y.sum() > 0)
        float(y.max())
        y.tolist()
        y.cpu().tolist()  # one read: the host copy is a host tensor
        (y > 0).nonzero()
        y[y > 0]
        torch.repeat_interleave(torch.arange(3, device=w.device), y[0, :3].long().abs())
        torch.bincount(y[0].long().abs(), minlength=4)  # two reads on CUDA: min and max

    count = _counted(step, w)
    assert count.syncs_by_kind() == {
        "item": 1,
        "bool": 1,
        "float": 1,
        "tolist": 1,
        "cpu": 1,
        "nonzero": 1,
        "boolean mask": 1,
        "repeat_interleave": 1,
        "bincount": 2,
    }
    sites = {site.rsplit(":", 1)[0] for site in count.syncs_by_site()}
    assert sites == {"tests/unit/test_probe.py"}


def test_host_tensors_are_free_and_copies_to_the_device_count():
    w = torch.randn(4, 4)

    def step(probe):
        heights = torch.tensor([1, 2, 1])  # host-made: reading it costs nothing
        rows = heights.repeat_interleave(heights)
        (rows == 2).nonzero().tolist()
        heights.sum().item()
        rows.to(w.device)  # a blocking host-to-device copy
        rows.to(w.device, non_blocking=True)  # asynchronous once pinned: not a sync
        torch.tensor([0, 1], device=w.device)  # host data copied over
        z = torch.zeros(3, device=w.device)  # a device factory: a launch, no copy
        z.sum().item()

    count = _counted(step, w)
    assert count.syncs_by_kind() == {"h2d": 2, "item": 1}
    assert sum(count.async_copies.values()) == 1


def test_device_propagates_through_ops_and_in_place_writes():
    w = torch.randn(3)

    def step(probe):
        host = torch.zeros(3)
        host.add_(w)  # the target now holds device data
        assert probe.is_device(host)
        host.sum().item()
        other = torch.zeros(3)
        other.copy_(w)  # a device-to-host copy, the target stays on the host
        assert not probe.is_device(other)
        w.to(w.device).sum().item()  # stays on the device

    count = _counted(step, w)
    assert count.syncs_by_kind() == {"item": 2, "d2h": 1}


def test_ops_collectives_and_nested_regions():
    w = torch.randn(4, 4)
    probe = DeviceProbe()
    probe.mark(w)
    with probe.tracking(), probe.region("outer") as outer:
        w.add(1)
        with probe.region("inner") as inner:
            w.mul(2).sum()
    assert inner.ops == {"aten::mul": 1, "aten::sum": 1}
    assert outer.n_ops == 3 and outer.n_syncs == 0 and outer.calls == 1
    # by the line that dispatched them: `w.add(1)` once, `w.mul(2).sum()` twice
    assert sorted(outer.ops_by_site.values()) == [1, 2]
    assert all(site.startswith("tests/unit/test_probe.py:") for site in outer.ops_by_site)
    assert outer.ops_by_site.keys() > inner.ops_by_site.keys()


def test_ops_sites_table_sums_files_and_the_lines_left_out():
    sites = {"muon/a.py:1": 5, "muon/a.py:9": 3, "muon/b.py:2": 2}
    table = ops_sites_table({"optimizer.step": {"ops_by_site": sites}}, top=1)
    assert "| muon/a.py | 8 |" in table and "| muon/b.py | 2 |" in table
    assert "| muon/a.py:1 | 5 |" in table and "| 2 other lines | 5 |" in table


def test_wrap_counts_every_call_and_restores_the_method():
    class Box:
        def run(self, x):
            return x.sum().item()

    box, w = Box(), torch.ones(2)
    probe = DeviceProbe()
    probe.mark(w)
    with probe.tracking(), probe.wrap(box, "run", "run") as count:
        box.run(w)
        box.run(w)
    assert count.calls == 2 and count.n_syncs == 2
    assert "run" not in box.__dict__


def test_all_on_device_counts_every_tensor_as_a_device_tensor():
    def step():
        heights = torch.tensor([1, 2, 1])  # host-made, yet on the device here
        heights.sum().item()
        int(heights.max())
        heights.tolist()
        heights.repeat_interleave(heights)
        torch.bincount(heights, minlength=4)

    with all_on_device() as count:
        step()
    assert count.syncs_by_kind() == {
        "item": 1,
        "int": 1,
        "tolist": 1,
        "repeat_interleave": 1,
        "bincount": 2,
    }
    assert count.ops["aten::sum"] == 1 and count.ops["aten::max"] == 1
    assert count.calls == 1
    with all_on_device() as empty:
        pass
    assert empty.n_ops == 0 and empty.n_syncs == 0
