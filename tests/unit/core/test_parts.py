"""Versions split into part files (format version 2): exact bytes, reading, and refusals.

The split buckets here are written in one process by ``write_split``, which lays parameters
out as FSDP2 does (rows chunked like ``torch.chunk``, trailing ranks possibly empty); the
real collective writer is tested on gloo process groups in tests/integration/sharded/.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from helpers import old_pointer

from deltasync import (
    BF16ChangeDetector,
    ConfigError,
    DeltaReceiver,
    FormatError,
    IntegrityError,
    NotFoundError,
    Pointer,
    fingerprint,
    open_store,
)
from deltasync.format.fingerprint import fingerprint_slice_share, format_fingerprint
from deltasync.format import ChainEntry, Change, PartEntry, encode_delta, part_path, read_header, sha256_hex
from deltasync.reader.parts import AnchorSlice, decode_version, encode_anchor_part, fetch_version
from deltasync.cli import main


def rows(shape: tuple[int, ...], part: int, parts: int) -> tuple[int, int]:
    """The flat range FSDP2's Shard(0) gives rank ``part`` of ``parts``."""
    n0, row = shape[0], math.prod(shape[1:])
    chunk = -(-n0 // parts)
    return min(part * chunk, n0) * row, min((part + 1) * chunk, n0) * row


def write_split(store, states: list[dict[str, torch.Tensor]], parts: int, codec: str = "zstd") -> None:
    """Publish ``states`` as anchor 0 and deltas 1.. with every version in ``parts`` files."""
    chain: list[ChainEntry] = []
    total = sum(t.numel() for t in states[0].values())
    for version, state in enumerate(states):
        fp = fingerprint(state)
        files = []
        for part in range(parts):
            ranges = {name: rows(tuple(t.shape), part, parts) for name, t in state.items()}
            if version == 0:
                slices = [AnchorSlice(n, tuple(t.shape), *ranges[n], t.reshape(-1)[slice(*ranges[n])]) for n, t in state.items()]
                data = encode_anchor_part(slices, version=0, fingerprint=fp, total=total, part=part, parts=parts)
                changed = sum(e - b for b, e in ranges.values())
                kind = "anchor"
            else:
                changes = {}
                for name, new in state.items():
                    old = states[version - 1][name].reshape(-1)
                    flat = new.reshape(-1)
                    begin, end = ranges[name]
                    index = torch.nonzero(flat[begin:end].view(torch.int16) != old[begin:end].view(torch.int16)).reshape(-1) + begin
                    if index.numel():
                        changes[name] = Change(index=index, new=flat[index], old=old[index])
                data = encode_delta(
                    changes, version=version, anchor=0, codec=codec, total=total, fingerprint=fp,
                    base_fingerprint=fingerprint(states[version - 1]), part=(part, parts),
                    numels={n: t.numel() for n, t in state.items()},
                )  # fmt: skip
                changed = sum(c.index.numel() for c in changes.values())
                kind = "delta"
            path = part_path(kind, version, part)
            store.write_bytes(path, data)
            files.append(PartEntry(path=path, nbytes=len(data), sha256=sha256_hex(data), changed=changed))
        chain.append(
            ChainEntry(
                version=version, kind=kind, path="", nbytes=sum(f.nbytes for f in files), sha256="",
                fingerprint=fp, changed=sum(f.changed for f in files), parts=tuple(files),
            )
        )  # fmt: skip
        pointer = Pointer.from_chain(version=version, anchor=0, fingerprint=fp, total=total, chain=tuple(chain))
        store.write_bytes("latest.json", pointer.to_bytes())


def bits(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int16).view(torch.bfloat16)


# A state FSDP2 would split unevenly over 2 ranks: "a" has 3 rows (2 + 1), "b" has 1 (1 + 0).
STATE0 = {"a.weight": bits(0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0).view(3, 2), "b.bias": bits(0x3F00)}
STATE1 = {"a.weight": bits(0x3F80, 0x4001, 0x4040, 0x4080, 0x40A0, 0x40BF).view(3, 2), "b.bias": bits(0x3F01)}


@pytest.fixture
def split(tmp_path):
    store = open_store(tmp_path / "b")
    write_split(store, [STATE0, STATE1], parts=2)
    return store


def test_split_anchor_part_bytes(split) -> None:
    """The exact bytes of part 1 of the anchor in docs/protocol.md section 18."""
    data = split.read_bytes("anchors/00000000.part1.safetensors")
    meta = (
        '{"__metadata__":{"anchor":"0","base":"none","changed":"2","codec":"raw",'
        f'"fingerprint":"{fingerprint(STATE0)}","format":"deltasync","format_version":"2","kind":"anchor",'
        '"params":"2","part":"1","parts":"2",'
        '"slices":"[[\\"a.weight\\",[3,2],4,6],[\\"b.bias\\",[1],1,1]]","total":"7","version":"0"},'
        '"a.weight":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},'
        '"b.bias":{"dtype":"BF16","shape":[0],"data_offsets":[4,4]}}'
    ).encode()
    meta += b" " * (-len(meta) % 8)
    assert data == len(meta).to_bytes(8, "little") + meta + bytes.fromhex("a040c040")


def test_protocol_md_example_is_current(split) -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "protocol.md").read_text()
    section = doc[doc.index("## 18. Split versions"):]
    data = split.read_bytes("anchors/00000000.part1.safetensors")
    header = data[8 : 8 + int.from_bytes(data[:8], "little")].decode().rstrip()
    assert header in section and "420 bytes" in section and "header length 408" in section
    text = split.read_bytes("latest.json").decode()
    anchor_entry = text[text.index('  {\n   "changed": 7') : text.index('   "version": 0\n  }') + len('   "version": 0\n  }')]
    assert anchor_entry in section


def test_split_pointer_bytes(split) -> None:
    pointer = json.loads(split.read_bytes("latest.json"))
    assert pointer["format_version"] == 3  # the pointer's format; the part files are format 2
    (entry,) = pointer["chain"]
    assert sorted(entry) == ["changed", "fingerprint", "kind", "nbytes", "parts", "version"]
    assert [p["path"] for p in entry["parts"]] == ["deltas/00000001.part0.safetensors", "deltas/00000001.part1.safetensors"]
    assert [p["changed"] for p in entry["parts"]] == [2, 1] and entry["changed"] == 3
    assert entry["nbytes"] == sum(p["nbytes"] for p in entry["parts"])
    (anchor,) = pointer["anchors"]
    assert [p["path"] for p in anchor["parts"]] == ["anchors/00000000.part0.safetensors", "anchors/00000000.part1.safetensors"]
    assert [p["changed"] for p in anchor["parts"]] == [5, 2] and anchor["changed"] == 7
    # Canonical serialization, as for format version 1.
    assert split.read_bytes("latest.json") == Pointer.from_bytes(split.read_bytes("latest.json")).to_bytes()


def test_a_format_2_bucket_is_still_read(split) -> None:
    """A bucket written before format 3: the same files under a format 2 pointer."""
    pointer = Pointer.from_bytes(split.read_bytes("latest.json"))
    split.write_bytes("latest.json", old_pointer(pointer, 2))
    assert json.loads(split.read_bytes("latest.json"))["chain"][0]["parts"][1]["path"] == "anchors/00000000.part1.safetensors"
    assert Pointer.from_bytes(split.read_bytes("latest.json")) == pointer
    receiver, _ = receiver_at_anchor(split)
    assert receiver.fingerprint == fingerprint(STATE0)
    assert receiver.sync() == 1 and receiver.fingerprint == fingerprint(STATE1) and receiver.verify()
    got = receiver.state_dict()
    assert all(torch.equal(got[k].view(torch.int16), STATE1[k].view(torch.int16)) for k in STATE1)


def test_a_version_of_one_part_is_not_split(tmp_path) -> None:
    """One writer writes a plain format-version-1 file; a pointer listing a single part is refused."""
    store = open_store(tmp_path / "b")
    write_split(store, [STATE0], parts=1)
    with pytest.raises(FormatError, match=r"version 0 lists 1 part\(s\); a split version has at least 2"):
        DeltaReceiver(store).pointer()


@pytest.mark.parametrize("codec", ["zstd", "raw"])
def test_receiver_reads_split_versions_exactly(tmp_path, codec: str) -> None:
    store = open_store(tmp_path / "b")
    states = [STATE0, STATE1]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # random flips, including elements at the part boundaries
        new = {}
        for name, t in states[-1].items():
            flat = t.reshape(-1).view(torch.int16).clone()
            flip = torch.rand(flat.numel(), generator=gen) < 0.5
            flat[flip] += 1
            new[name] = flat.view(torch.bfloat16).view(t.shape)
        states.append(new)
    write_split(store, states, parts=3, codec=codec)
    receiver = DeltaReceiver(store)
    assert receiver.sync(0) == 0
    for version in range(1, len(states)):
        assert receiver.sync(version) == version
        got = receiver.state_dict()
        for name, want in states[version].items():
            assert torch.equal(got[name].view(torch.int16), want.view(torch.int16)), (version, name)
        assert receiver.fingerprint == fingerprint(states[version])
    late = DeltaReceiver(store)
    late.sync()
    assert late.fingerprint == fingerprint(states[-1]) and late.verify()


def test_anchor_parts_hold_slices_and_decode_whole(split) -> None:
    (entry,) = Pointer.from_bytes(split.read_bytes("latest.json")).anchors
    files = fetch_version(split, entry)
    assert [(name, begin, end) for data in files for name, _, begin, end in read_header(data, where="x").slices] == [
        ("a.weight", 0, 4), ("b.bias", 0, 1), ("a.weight", 4, 6), ("b.bias", 1, 1),
    ]  # fmt: skip
    header, tensors = decode_version(files, entry, url=split.url)
    assert (header.parts, header.params, fingerprint(tensors)) == (None, 2, entry.fingerprint)


# --------------------------------------------------------------------------- refusals


def receiver_at_anchor(store) -> tuple[DeltaReceiver, tuple]:
    receiver = DeltaReceiver(store)
    receiver.sync(0)
    return receiver, (receiver.version, receiver.fingerprint, {k: v.clone() for k, v in receiver.state_dict().items()})


def assert_unchanged(receiver: DeltaReceiver, before: tuple) -> None:
    version, fp, state = before
    assert (receiver.version, receiver.fingerprint) == (version, fp)
    now = receiver.state_dict()
    assert all(torch.equal(now[k].view(torch.int16), state[k].view(torch.int16)) for k in state)


def rewrite_pointer(store, edit) -> None:
    body = json.loads(store.read_bytes("latest.json"))
    edit(body)
    store.write_bytes("latest.json", (json.dumps(body, sort_keys=True, indent=1) + "\n").encode())


def test_missing_part_refuses_the_version(split) -> None:
    receiver, before = receiver_at_anchor(split)
    split.delete(["deltas/00000001.part1.safetensors"])
    with pytest.raises(NotFoundError):
        receiver.sync()
    assert_unchanged(receiver, before)
    with pytest.raises(NotFoundError):
        DeltaReceiver(split).sync()  # a fresh reader too


def test_tampered_part_refuses_the_version(split) -> None:
    receiver, before = receiver_at_anchor(split)
    data = bytearray(split.read_bytes("deltas/00000001.part1.safetensors"))
    data[-1] ^= 1
    split.write_bytes("deltas/00000001.part1.safetensors", bytes(data))
    with pytest.raises(IntegrityError, match=r"part 1 of version 1\): SHA-256"):
        receiver.sync()
    assert_unchanged(receiver, before)


def test_extra_part_refuses_the_version(split) -> None:
    receiver, before = receiver_at_anchor(split)
    data = split.read_bytes("deltas/00000001.part1.safetensors")
    split.write_bytes("deltas/00000001.part2.safetensors", data)

    def add_part(body):
        entry = body["chain"][0]
        entry["parts"].append({**entry["parts"][1], "path": "deltas/00000001.part2.safetensors"})
        entry["nbytes"] += entry["parts"][1]["nbytes"]
        entry["changed"] += entry["parts"][1]["changed"]

    rewrite_pointer(split, add_part)
    with pytest.raises(FormatError, match=r"part 0 of version 1\): the file is part 0 of 2, the pointer lists it as part 0 of 3"):
        receiver.sync()
    assert_unchanged(receiver, before)


def test_a_part_from_another_version_or_a_dropped_part_is_refused(split) -> None:
    receiver, before = receiver_at_anchor(split)

    def drop_part(body):
        entry = body["chain"][0]
        gone = entry["parts"].pop()
        entry["nbytes"] -= gone["nbytes"]
        entry["changed"] -= gone["changed"]

    rewrite_pointer(split, drop_part)
    with pytest.raises(FormatError, match="lists 1 part"):
        receiver.sync()
    assert_unchanged(receiver, before)


def test_overlapping_parts_are_refused(tmp_path) -> None:
    """Two parts that change the same element make the version ambiguous: refused."""
    store = open_store(tmp_path / "b")
    write_split(store, [STATE0, STATE1], parts=2, codec="raw")
    pointer = Pointer.from_bytes(store.read_bytes("latest.json"))
    part0 = store.read_bytes("deltas/00000001.part0.safetensors")
    header = read_header(part0, where="x")
    # rewrite part 1 so that it changes element 1 of a.weight again (part 0 already does)
    data = encode_delta(
        {"a.weight": Change(index=torch.tensor([1]), new=bits(0x4002))}, version=1, anchor=0, codec="raw",
        total=7, fingerprint=header.fingerprint, base_fingerprint=header.base_fingerprint, part=(1, 2),
    )  # fmt: skip
    store.write_bytes("deltas/00000001.part1.safetensors", data)
    parts = list(pointer.delta(1).parts)
    parts[1] = PartEntry(path=parts[1].path, nbytes=len(data), sha256=sha256_hex(data), changed=1)
    import dataclasses

    entry = dataclasses.replace(pointer.delta(1), parts=tuple(parts), nbytes=parts[0].nbytes + len(data))
    store.write_bytes("latest.json", dataclasses.replace(pointer, chain=(entry,)).to_bytes())
    receiver, before = receiver_at_anchor(store)
    with pytest.raises(FormatError, match="at or before element 1 that an earlier part changes"):
        receiver.sync()
    assert_unchanged(receiver, before)


def test_anchor_parts_that_leave_a_gap_are_refused(tmp_path) -> None:
    store = open_store(tmp_path / "b")
    fp = fingerprint(STATE0)
    a = STATE0["a.weight"].reshape(-1)
    files = []
    for part, (begin, end) in enumerate([(0, 2), (4, 6)]):  # elements 2..3 of a.weight are in no part
        slices = [AnchorSlice("a.weight", (3, 2), begin, end, a[begin:end]), AnchorSlice("b.bias", (1,), part, 1, STATE0["b.bias"][part:])]
        data = encode_anchor_part(slices, version=0, fingerprint=fp, total=7, part=part, parts=2)
        store.write_bytes(part_path("anchor", 0, part), data)
        files.append(PartEntry(path=part_path("anchor", 0, part), nbytes=len(data), sha256=sha256_hex(data), changed=end - begin + 1 - part))
    entry = ChainEntry(version=0, kind="anchor", path="", nbytes=sum(f.nbytes for f in files), sha256="",
                       fingerprint=fp, changed=sum(f.changed for f in files), parts=tuple(files))  # fmt: skip
    store.write_bytes("latest.json", Pointer.from_chain(version=0, anchor=0, fingerprint=fp, total=7, chain=(entry,)).to_bytes())
    with pytest.raises(FormatError, match="'a.weight' continues at element 4, the parts before end at 2"):
        DeltaReceiver(store).sync()


def test_format_version_1_pointer_cannot_list_parts(split) -> None:
    split.write_bytes("latest.json", old_pointer(Pointer.from_bytes(split.read_bytes("latest.json")), 1))
    with pytest.raises(FormatError, match="a format_version 1 pointer cannot list part files"):
        DeltaReceiver(split).sync()


def test_misnamed_part_is_refused(split) -> None:
    rewrite_pointer(split, lambda body: body["chain"][0]["parts"][1].update(path="deltas/00000001.part7.safetensors"))
    with pytest.raises(FormatError, match=r"part 1 of version 1 is named 'deltas/00000001.part7.safetensors'"):
        DeltaReceiver(split).pointer()


# --------------------------------------------------------------------------- CLI and refusals at construction


def test_cli_on_a_split_bucket(split, tmp_path, capsys) -> None:
    assert main(["inspect", str(tmp_path / "b" / "anchors/00000000.part1.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "part         1 of 2" in out and "a.weight   3x2         4..6" in out
    assert main(["verify", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "version 1: ok  delta" in out and "2 parts" in out
    assert main(["stats", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "files" in out.splitlines()[0]
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "b", broken)
    (broken / "deltas/00000001.part0.safetensors").write_bytes(b"x")
    assert main(["verify", str(broken)]) == 1
    err = capsys.readouterr().err
    assert "the first bad version is 1 (deltas/00000001.part0.safetensors, deltas/00000001.part1.safetensors)" in err


def test_deepspeed_zero3_parameters_are_refused() -> None:
    model = torch.nn.Linear(4, 2)
    model.weight.ds_tensor = torch.zeros(4)  # what a ZeRO-3 partitioned parameter carries
    with pytest.raises(ConfigError, match=r"parameter 'weight' is a DeepSpeed ZeRO-3 partitioned parameter \(it has ds_tensor\)"):
        BF16ChangeDetector(model)


def test_fingerprint_shares_add_up() -> None:
    state = {"a.weight": torch.randn(7, 3).to(torch.bfloat16), "b": torch.randn(5).to(torch.bfloat16)}
    total = 0
    for name, t in state.items():
        flat = t.reshape(-1)
        for begin, end in ((0, 4), (4, 4), (4, flat.numel())):
            total += fingerprint_slice_share(name, flat[begin:end], begin)
    assert format_fingerprint(total) == fingerprint(state)


def test_a_part_listed_as_a_single_file_is_refused(split) -> None:
    data = split.read_bytes("anchors/00000000.part1.safetensors")
    split.write_bytes("anchors/00000000.safetensors", data)
    entry = ChainEntry(version=0, kind="anchor", path="anchors/00000000.safetensors", nbytes=len(data),
                       sha256=sha256_hex(data), fingerprint=fingerprint(STATE0), changed=7)  # fmt: skip
    split.write_bytes("latest.json", Pointer.from_chain(version=0, anchor=0, fingerprint=entry.fingerprint, total=7, chain=(entry,)).to_bytes())
    with pytest.raises(FormatError, match="the file is part 1 of 2, the pointer lists one file"):
        DeltaReceiver(split).sync()
