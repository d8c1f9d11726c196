"""Decode steps through the CUDA-graph buffers (inflight.cuda_graphs). Graphs themselves need a GPU
(make gpu-check captures them); here the same static buffers are filled, padded and run eagerly,
which checks everything but the capture: greedy tokens equal the plain runner's, padding rows
change nothing, steps the graphs do not fit run the plain way."""
import random

import pytest

from inflight import EngineConfig, LLMEngine, SamplingParams
from inflight.cuda_graphs import DecodeGraphs, capture_sizes


def test_capture_sizes_cover_every_batch_up_to_the_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(1000)[-1] == 512
    for limit in (3, 17, 256):
        sizes = capture_sizes(limit)
        assert sizes == sorted(set(sizes)) and sizes[-1] == limit
        assert all(b - a <= 8 for a, b in zip(sizes, sizes[1:]))      # padding: under 8 rows a step


def engine_for(checkpoint, graph_sizes=None, **overrides):
    config = dict(device="cpu", dtype="float32", max_num_seqs=12, max_num_batched_tokens=64, num_kv_blocks=256)
    engine = LLMEngine.from_pretrained(checkpoint, EngineConfig(**{**config, **overrides}))
    assert engine.runner.graphs is None                 # CPU: never captured by itself
    if graph_sizes:
        graphs = DecodeGraphs(engine.runner, graph_sizes, capture=False)
        engine.runner.graphs = graphs
        graphs.used = []
        for size, replay in list(graphs.replays.items()):
            graphs.replays[size] = lambda size=size, replay=replay: (graphs.used.append(size), replay())
    return engine


def test_decode_steps_through_the_graph_buffers_give_the_plain_tokens(tiny_checkpoint):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=True) for _ in prompts]
    plain = [o.token_ids for o in engine_for(tiny_checkpoint).generate(prompts, params)]
    engine = engine_for(tiny_checkpoint, [1, 2, 4, 8])
    assert [o.token_ids for o in engine.generate(prompts, params)] == plain
    used = set(engine.runner.graphs.used)
    assert {1, 2, 4, 8} & used and len(engine.runner.graphs.used) > 10, used
    assert engine.stats()["kv_blocks_used"] == 0


def test_padding_rows_write_no_kv_and_wide_steps_run_plainly(tiny_checkpoint):
    """3 sequences pad to 4 (one padding row, slot -1): the cache outside their slots is untouched;
    12 sequences exceed the largest size (8) and take the plain path."""
    engine = engine_for(tiny_checkpoint, [4, 8])
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), [5 + i, 6, 7], params)
    engine.step()                                       # the prompts: a plain step
    k_cache = engine.runner.kv_caches[0][0]
    before = k_cache.clone()
    engine.step()                                       # 3 decodes, padded to 4
    assert engine.runner.graphs.used == [4]
    table = engine.scheduler.table
    rows = [int(r) for r in range(len(table.request_ids)) if table.request_ids[r] in ("0", "1", "2")]
    written = {(table.blocks(r)[3 // 16], 3 % 16) for r in rows}       # position 3 of each sequence
    changed = {tuple(i) for i in (k_cache != before).flatten(2).any(2).nonzero().tolist()}
    assert changed == written
    while engine.has_unfinished():
        engine.step()
    for i in range(12):
        engine.add_request(f"w{i}", [9, 10], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    used = len(engine.runner.graphs.used)
    while engine.has_unfinished():
        engine.step()
    assert len(engine.runner.graphs.used) == used       # 12 > 8: never through the graphs


@pytest.mark.parametrize("value", [1, "yes", None])
def test_enforce_eager_must_be_a_boolean(value):
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager=value)
