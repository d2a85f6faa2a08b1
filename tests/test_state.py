"""The parameter store's slots, the stash, gradient hand-off and checksummed concurrency."""

import pytest
import torch

from tiertrain.activations.stash import HiddenStash
from tiertrain.config import ModelConfig
from tiertrain.device import AsyncCpuDevice, Device
from tiertrain.execute.walk import UnitWalk
from tiertrain.io import FileHandle, Storage
from tiertrain.models import build_model
from tiertrain.models.base import UnitRef
from tiertrain.state.grads import GradStore
from tiertrain.state.layout import PARAM_ALIGN, UNIT_ALIGN, FlatLayout
from tiertrain.state.regions import TieredRegions
from tiertrain.state.store import ParamStore
from tiertrain.update.baseline import RegionGrads, RegionParams

KIB = 1 << 10


@pytest.fixture
def setup(tmp_path):
    model, _ = build_model(
        ModelConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=256, max_seq_len=32),
        param_dtype=torch.float32,
        seed=0,
    )
    layout = FlatLayout(model)
    st = Storage([str(tmp_path / "s")], chunk_bytes=256 * KIB, stripe_bytes=64 * KIB, checksum_block=64 * KIB)
    yield model, layout, st
    st.close()


def test_layout_alignment(setup):
    model, layout, _ = setup
    for unit in layout.units:
        assert unit.offset % UNIT_ALIGN == 0 and unit.numel % UNIT_ALIGN == 0
        assert all(r.offset % PARAM_ALIGN == 0 for r in unit.params)
    assert layout.n_params == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="not a multiple of 64"):
        layout.segments(1, 10, 100)


def region(layout, st, name, dtype=torch.float32, host_bytes=0):
    decl = TieredRegions.declare(
        layout, f"{name}.bin", dtype, host_bytes, st.record_align, name=name, owner="test", checkpointed=False
    )
    return TieredRegions(layout, st, decl)


def param_store(layout, st, slots):
    return ParamStore(layout, RegionParams(region(layout, st, "params")), Device(torch.device("cpu")), slots=slots)


def fill(store, layout):
    for unit in layout.units:
        store.write(unit.index, torch.full((unit.numel,), float(unit.index))).get()


def test_slots_prefetch_evict_and_invalidate(setup):
    _, layout, st = setup
    store = param_store(layout, st, 2)
    fill(store, layout)
    flat = store.acquire(0)
    assert float(flat[0]) == 0.0
    rec = layout.units[0].params[0]
    assert rec.param.data_ptr() == flat.data_ptr() + 4 * rec.offset  # modules see views of the slot
    store.prefetch([1, 2])  # one free slot: loads 1; cannot evict 0 (bound)
    states = sorted((s.unit, s.state) for s in store.slots)
    assert states == [(0, "bound"), (1, "loading")]
    store.release(0)
    assert float(store.acquire(1)[0]) == 1.0 and store.stats.fetches == 2
    store.release(1)
    store.acquire(2)  # evicts the least recently used (unit 0)
    assert sorted(s.unit for s in store.slots) == [1, 2]
    with pytest.raises(RuntimeError, match="still bound"):
        store.write(2, torch.zeros(layout.units[2].numel))
    store.release(2)
    store.write(2, torch.full((layout.units[2].numel,), 7.0)).get()  # invalidates the stale copy
    assert float(store.acquire(2)[0]) == 7.0
    store.release(2)
    hits = store.stats.hits
    store.acquire(1)
    assert store.stats.hits == hits + 1  # still resident: no read
    store.close()


def test_a_freed_slot_starts_the_next_read_at_once(setup):
    """Leaving a unit starts the read of the visit after the next into its slot, while the next
    one's may still run: with two slots the reads follow one another (prefetching only on
    entering a unit left the disk idle whenever a unit computed longer than the next one read)."""
    _, layout, st = setup
    store = param_store(layout, st, 2)
    fill(store, layout)
    order = [UnitRef(index=u, role="block", module=None) for u in (0, 1, 2, 3)]
    walk = UnitWalk(store, order)
    walk.enter(order[0])
    assert sorted(s.unit for s in store.slots) == [0, 1]  # entering prefetched the next one
    walk.leave(order[0])
    assert sorted(s.unit for s in store.slots) == [1, 2]  # unit 0's slot took unit 2 at once
    for ref in order[1:]:
        walk.enter(ref)
        assert float(walk.flats[ref.index][0]) == float(ref.index)
        walk.leave(ref)
    assert store.stats.fetches == 4  # each unit read once
    store.close()


def test_slots_refuse_when_all_bound(setup):
    _, layout, st = setup
    store = param_store(layout, st, 2)
    fill(store, layout)
    store.acquire(0), store.acquire(1)
    with pytest.raises(RuntimeError, match="no device slot free for unit 2: all 2 are bound"):
        store.acquire(2)
    with pytest.raises(ValueError, match="at least 2 device slots"):
        param_store(layout, st, 1)
    store.close()


DEVICES = {"cpu": lambda: Device(torch.device("cpu")), "async": lambda: AsyncCpuDevice(delay=0.001)}


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("host_entries", [0, 3, 12])
def test_stash_spills_and_returns_every_entry(tmp_path, host_entries, device):
    st = Storage([str(tmp_path / "s")], chunk_bytes=256 * KIB, checksum_block=64 * KIB)
    shape = (2, 8, 32)
    stash = HiddenStash(
        st, DEVICES[device](), shape=shape, dtype=torch.float32, entries=12, host_bytes=host_entries * 4096
    )
    assert stash.host_slots == host_entries and stash.spilled == 12 - host_entries and stash.entry_bytes == 4096
    vals = [torch.randn(shape) for _ in range(12)]
    for i, v in enumerate(vals):
        stash.put(i, v)
    for i in reversed(range(12)):  # backward order, prefetching the next one
        stash.prefetch(i - 1)
        assert torch.equal(stash.get(i), vals[i])
        stash.free(i)
    with pytest.raises(ValueError, match=r"stash entries are \(2, 8, 32\), got \(1, 8, 32\)"):
        stash.put(0, torch.zeros(1, 8, 32))
    stash.close()
    st.close()


@pytest.mark.parametrize("device", ["cpu", "async"])
def test_grad_store_hands_off_and_reuses_buffers(setup, device):
    _, layout, st = setup
    home = region(layout, st, "grads")
    grads = GradStore(layout, RegionGrads(home), DEVICES[device]())
    slot = torch.zeros(layout.max_unit_numel)
    for u in reversed(range(len(layout))):
        layout.bind(u, slot)  # in a slot, as the executor has it: its .grad is bound
        grads.begin(u)
        for rec in layout.units[u].params:
            rec.param.grad.fill_(u + 1.0)
        assert all(torch.all(g == u + 1.0) for g in grads.views(u))  # the same buffer, seen directly
        grads.end(u)
        assert all(rec.param.grad is None for rec in layout.units[u].params)
    grads.flush()
    out = torch.zeros(layout.max_unit_numel)
    for unit in layout.units:
        home.read(unit.index, out, 0, unit.numel).get()
        rec = unit.params[0]
        assert torch.all(out[rec.offset : rec.offset + rec.numel] == unit.index + 1.0)
    norms = [n for u in range(len(layout)) for n in grads.norms[u]]
    assert len(norms) == sum(len(u.params) for u in layout.units)
    expected = torch.linalg.vector_norm(torch.stack(norms))
    assert torch.equal(grads.total_norm(), expected)
    grads.close()


@pytest.mark.slow
def test_checksummed_reads_never_see_half_written_blocks(tmp_path):
    """Writers keep patching small pieces of shared 64 KiB checksum blocks while readers keep
    reading other pieces of the same blocks (verifying whole blocks): no spurious checksum
    errors, no lost bytes. Without the block locks on the read path this fails at once."""
    import threading
    import time

    block, piece, nblocks = 64 * KIB, 3000, 4
    size = block * nblocks
    kw = dict(checksum=True, checksum_block=block, threads=8, chunk_bytes=block)
    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    w_offs = [b * block + 1000 for b in range(nblocks)]  # one patched piece per block
    r_offs = [b * block + 20000 for b in range(nblocks)]  # one untouched piece per block
    with FileHandle(tmp_path / "r", "w", size=size, **kw) as f:
        f.write(data)
        stop, errors = threading.Event(), []

        def reader(off):
            out = torch.zeros(piece, dtype=torch.uint8)
            while not stop.is_set():
                try:
                    f.read(out, file_offset=off)
                    assert torch.equal(out, data[off : off + piece])
                except Exception as exc:  # noqa: BLE001 - collected and re-raised below
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=reader, args=(off,)) for off in r_offs]
        for t in threads:
            t.start()
        deadline, last = time.time() + 2.0, {}
        while time.time() < deadline and not errors:
            futs = []
            for off in w_offs:
                last[off] = torch.randint(0, 256, (piece,), dtype=torch.uint8)
                futs.append(f.pwrite(last[off], file_offset=off))
            for x in futs:
                x.get()
        stop.set()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        for off, buf in last.items():
            data[off : off + piece] = buf
        out = torch.zeros(size, dtype=torch.uint8)
        f.read(out)
        assert torch.equal(out, data)
        assert f.verify() == size


def test_kept_graph_takes_parameters_from_where_the_unit_is_bound_now():
    """A kept graph does not hold on to the slot its weights were in during the forward:
    the slot is overwritten, the unit bound elsewhere, and the backward still gives the
    gradients of the weights it ran with."""
    from tiertrain.activations.keep import KeptGraphs

    torch.manual_seed(0)
    w0 = torch.randn(8, 16)
    b0 = torch.randn(8)
    slot_a, slot_b = torch.empty(200), torch.empty(200)
    where = {"slot": slot_a}
    w = torch.nn.Parameter(torch.empty(8, 16))
    b = torch.nn.Parameter(torch.empty(8))

    def bind(flat):
        w.data, b.data = flat[:128].view(8, 16), flat[128:136]

    def block(x):
        return torch.tanh(torch.nn.functional.linear(x, w, b)) * b

    slot_a[:128], slot_a[128:136] = w0.reshape(-1), b0
    bind(slot_a)
    kept = KeptGraphs(1 << 20, lambda u: where["slot"])
    x = torch.randn(4, 16)
    out, ok = kept.forward((0, 0), (7,), block, x, lambda nbytes, kept_bytes: True)
    assert ok and kept.kept_bytes > 0
    slot_a.fill_(float("nan"))  # another unit loaded into the forward's slot
    slot_b[:128], slot_b[128:136] = w0.reshape(-1), b0
    where["slot"] = slot_b
    bind(slot_b)
    w.grad, b.grad = torch.zeros(8, 16), torch.zeros(8)
    dx = kept.backward((0, 0), torch.ones(4, 8))

    rw, rb, rx = w0.clone().requires_grad_(), b0.clone().requires_grad_(), x.clone().requires_grad_()
    ref = torch.tanh(torch.nn.functional.linear(rx, rw, rb)) * rb
    ref.backward(torch.ones(4, 8))
    assert torch.equal(out, ref.detach())
    assert torch.equal(dx, rx.grad) and torch.equal(w.grad, rw.grad) and torch.equal(b.grad, rb.grad)
    assert kept.kept_bytes == 0 and kept.peak_bytes > 0


def test_kept_graph_over_budget_is_dropped():
    from tiertrain.activations.keep import KeptGraphs

    kept = KeptGraphs(64, lambda u: torch.empty(0))
    x = torch.randn(32, 32)
    out, ok = kept.forward((0, 0), (), lambda t: torch.tanh(t) * 2, x, lambda nbytes, kept_bytes: True)
    assert not ok and (0, 0) not in kept and kept.kept_bytes == 0
    assert torch.equal(out, torch.tanh(x) * 2)


@pytest.mark.parametrize("device", ["cpu", "async"])
def test_a_failed_load_leaves_no_stale_slot(setup, device):
    """A read that fails (a damaged file, a dead engine) is reported, and the slot it was
    loading holds nothing: a later acquire loads the unit afresh instead of binding what the
    slot held before."""
    from tiertrain.io import IOFuture

    _, layout, st = setup
    source = RegionParams(region(layout, st, "params"))
    store = ParamStore(layout, source, DEVICES[device](), slots=2)
    fill(store, layout)
    real, fail = source.load, {"on": True}

    def flaky(u, out, slot=None):
        if u == 3 and fail["on"]:  # the read fails: nothing reaches the slot
            f = IOFuture.completed(0)
            f._error = OSError(5, "injected read error")
            return f
        return real(u, out, slot)

    source.load = flaky
    assert float(store.acquire(1)[0]) == 1.0
    store.release(1)
    with pytest.raises(OSError, match="injected read error"):
        store.acquire(3)
    fail["on"] = False
    assert float(store.acquire(3)[0]) == 3.0  # loaded again, not a leftover
    store.release(3)
    store.close()
