"""``hf:PATH,stream=true``: lanes that read disjoint chunks covering every document each epoch, rows that continue
exactly from a saved position, and a run stopped by SIGTERM and resumed on another number of ranks that trains on
exactly the rows (and so the weights) of the uninterrupted run."""

import json

import numpy as np
import pytest
import torch

import polytrain
from polytrain.data import build_data, documents
from polytrain.data.stream import Lane, LaneState, StreamPlan
from polytrain.data.tokenizer import load_tokenizer
from polytrain.errors import ConfigError, DataError, RunStopped
from polytrain.train.example_ids import read

pytest.importorskip("tokenizers")

DOCS = [f"{w.upper()}, n. " + " ".join([w, "of", "the"] * (i % 7 + 1)) for i, w in
        enumerate(["love", "war", "dog", "cynic", "bore", "lawyer"] * 30)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("stream")
    for k in range(3):
        (out / f"part{k}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[k::3]))
    return out


def _stream(shards, **args):
    spec = f"hf:{shards / 'part*.jsonl'},stream=true,seq_len=16" + "".join(f",{k}={v}" for k, v in args.items())
    return build_data(spec, tokenizer="text").train


def test_lanes_read_disjoint_chunks_that_cover_every_document_each_epoch(shards, monkeypatch):
    stream = _stream(shards)
    chunks = stream.chunks(4)
    tok = load_tokenizer("text")
    docs_of = {lane: sorted(tuple(tok.encode(d) + [0]) for c in range(lane, len(chunks), 4)
                            for d in documents.read(chunks[c], "text", None, "t")) for lane in range(4)}
    assert sorted(sum(docs_of.values(), [])) == sorted(tuple(tok.encode(d) + [0]) for d in DOCS)
    read_by = {}
    real = documents.read

    def noting(chunk, *args, **kwargs):
        read_by.setdefault(current, []).append(chunks.index(chunk))
        return real(chunk, *args, **kwargs)

    monkeypatch.setattr(documents, "read", noting)
    for current in range(4):  # each lane (a rank of 4 reads one) for two of its epochs
        lane, tokens = Lane(stream, current, 4), []
        while lane.state.epoch < 2:
            tokens += lane.row()[0][:-1].tolist()  # (each row's last token is the next row's first)
        mine = [c for c in range(len(chunks)) if c % 4 == current]
        seen = read_by[current]
        assert sorted(seen[: len(mine)]) == sorted(seen[len(mine) : 2 * len(mine)]) == mine  # once an epoch
        ends = [i + 1 for i, t in enumerate(tokens) if t == 0]
        docs = [tuple(tokens[a:b]) for a, b in zip([0] + ends, ends)]
        count = len(docs_of[current])
        assert sorted(docs[:count]) == sorted(docs[count : 2 * count]) == docs_of[current]


def test_a_lane_continues_exactly_from_a_saved_state(shards):
    stream = _stream(shards)
    lane = Lane(stream, 1, 2)
    first = [lane.row() for _ in range(7)]
    saved = LaneState(*lane.state.as_list())
    rest = [lane.row() for _ in range(5)]
    again = Lane(stream, 1, 2, saved)
    assert all(np.array_equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(rest, [again.row() for _ in range(5)]))
    assert all(np.array_equal(a[0][-1:], b[0][:1]) for a, b in zip(first, first[1:]))  # rows overlap by one token


def test_lanes_batches_and_epochs_are_checked_before_anything_starts(shards):
    stream = _stream(shards)
    with pytest.raises(ConfigError, match="3 data-parallel ranks cannot share 4 lanes"):
        StreamPlan.make(_stream(shards, lanes=4), 8, 3)
    with pytest.raises(ConfigError, match="--batch-size 6: a stream's global batch takes as many rows of each of its "
                                          "4 lanes; use a multiple of 4"):
        StreamPlan.make(stream, 6, 4)
    with pytest.raises(DataError, match="chunk\\(s\\) cannot feed 1000 lanes"):
        StreamPlan.make(_stream(shards, lanes=1000), 1000, 1)
    run = dict(model="transformer_lm:layers=1,dim=16,heads=2", data=f"hf:{shards / 'part*.jsonl'},stream=true",
               tokenizer="text", progress="off", batch_size=4)
    with pytest.raises(ConfigError, match="a stream's length is not known before it is read; give --steps N"):
        polytrain.fit(strategy="single", epochs=1, **run)


@pytest.fixture(scope="module")
def resumed(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    run = dict(model="transformer_lm:layers=1,dim=16,heads=2", data=f"hf:{shards / 'part*.jsonl'},stream=true,seq_len=16",
               tokenizer="text", strategy="sync", steps=8, batch_size=8, optimizer="sgd", lr=0.5, progress="off",
               log_every=1, eval_every=0, seed=0)
    polytrain.fit(workers=4, log_example_ids=str(out / "full.ids"), save_model=str(out / "full.pt"), **run)
    mp = pytest.MonkeyPatch()
    mp.setenv("POLYTRAIN_INJECT_KILL", "rank=2,steps=3,signal=SIGTERM")  # rank 2 sends itself SIGTERM
    with pytest.raises(RunStopped) as stopped:
        polytrain.fit(workers=4, log_example_ids=str(out / "part.ids"), checkpoint_dir=str(out / "ck"), **run)
    mp.undo()
    polytrain.fit(workers=2, resume=True, log_example_ids=str(out / "part.ids"), checkpoint_dir=str(out / "ck"),
                  save_model=str(out / "resumed.pt"), **run)
    return out, stopped.value


def test_a_stream_stopped_by_sigterm_resumes_on_two_ranks_with_the_uninterrupted_runs_rows(resumed):
    out, stopped = resumed
    assert 3 <= stopped.step < 8 and stopped.checkpoint
    full, part = read(out / "full.ids"), read(out / "part.ids")
    assert sorted(full) == sorted(part) == list(range(1, 9))
    assert all(full[step]["ids"] == part[step]["ids"] for step in full)  # the same rows, step by step
    ids = [i for record in full.values() for i in record["ids"]]
    assert len(ids) == len(set(ids)) == 64  # none read twice
    one, two = (torch.load(out / f"{n}.pt", weights_only=True) for n in ("full", "resumed"))
    for key, value in one.items():  # trained on the same tokens: the same weights
        assert (two[key] - value).norm() <= 1e-5 * value.norm(), key


def test_bad_stream_arguments_are_one_line(shards, tmp_path):
    with pytest.raises(DataError, match="lanes must be an integer >= 1, got 0"):
        build_data(f"hf:{shards / 'part*.jsonl'},stream=true,lanes=0", tokenizer="text")
    with pytest.raises(DataError, match=r"no file matches .*nothing\*.jsonl"):
        build_data(f"hf:{shards / 'nothing*.jsonl'},stream=true", tokenizer="text")
    long = tmp_path / "long.jsonl"  # two documents, each longer than the chunks of 2 lanes: lane 1 begins none
    long.write_text("".join(json.dumps({"text": "x " * 5000}) + "\n" for _ in range(2)))
    stream = build_data(f"hf:{long},stream=true,lanes=2", tokenizer="text").train
    with pytest.raises(DataError, match="lane 1 of its chunks holds no document; give fewer lanes= or more data"):
        Lane(stream, 1, 2).row()


def test_a_model_vocabulary_smaller_than_the_tokenizers_is_refused_before_launch(shards):
    with pytest.raises(ConfigError, match="its vocabulary of 500 tokens is smaller than the data's token ids"):
        polytrain.fit(model="transformer_lm:layers=1,dim=16,heads=2,vocab=500", strategy="sync", workers=2,
                      data=f"hf:{shards / 'part*.jsonl'},stream=true", tokenizer="text", steps=1, batch_size=4,
                      progress="off")
