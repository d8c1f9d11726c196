"""The CPU attention backend (grouped_paged_attention) gives the reference's result on mixed steps:
decodes of many lengths cut into several groups, prefill chunks with context, fresh prefills,
GQA/MHA, non-contiguous views, fp64/fp32/bf16."""
import pytest
import torch

from inflight import attention
from inflight.attention import AttentionMetadata, grouped_paged_attention

from .test_kernels import make_step

ATOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def reference(step) -> torch.Tensor:
    """The reference paged_attention in float64 on the same inputs."""
    expected = torch.empty(step["q"].shape, dtype=torch.float64)
    return attention.paged_attention(step["q"].double(), step["k_cache"].double(), step["v_cache"].double(), expected,
                                     step["cu_seqlens_q"], step["seq_lens"], step["block_table"], step["scale"])


def run(step):
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), step["cu_seqlens_q"], step["seq_lens"],
                             step["block_table"], int(step["cu_seqlens_q"][-1]), int(step["seq_lens"].max()))
    out = grouped_paged_attention(step["q"], step["k_cache"], step["v_cache"], step["out"], meta, step["scale"])
    assert out is step["out"]
    return out, meta


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_steps_match_the_reference(seed, monkeypatch):
    rng = torch.Generator().manual_seed(200 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    # a small group budget, so the decodes split into several length-sorted groups
    monkeypatch.setattr(attention, "GROUP_KV_BYTES", pick([4096, 65536, 2**21]))
    cases = [(1, int(torch.randint(1, 400, (1,), generator=rng))) for _ in range(int(torch.randint(1, 40, (1,),
                                                                                              generator=rng)))]
    for _ in range(int(torch.randint(0, 3, (1,), generator=rng))):
        q_len = pick([2, 7, 33])
        cases.insert(int(torch.randint(len(cases) + 1, (1,), generator=rng)), (q_len, q_len + pick([0, 5, 70])))
    q_heads, kv_heads = pick([(4, 4), (8, 2), (6, 1)])
    dtype = pick([torch.float64, torch.float32, torch.bfloat16])
    step = make_step(cases, q_heads, kv_heads, pick([24, 64]), pick([16, 32]), dtype, seed=seed,
                     strided=pick([False, True]))
    out, meta = run(step)
    torch.testing.assert_close(out.double(), reference(step), atol=ATOL[dtype], rtol=0)
    decodes = sum(n == 1 for n, _ in cases)
    assert sum(len(g.token_idx) for g in meta.cpu_plan.groups) == decodes
    assert len(meta.cpu_plan.prefills) == len(cases) - decodes


def test_the_plan_is_built_once_per_step_and_reused_by_every_layer():
    step = make_step([(1, 50), (3, 20), (1, 9)], 8, 2, 64, 16, torch.float32)
    _, meta = run(step)
    plan = meta.cpu_plan
    grouped_paged_attention(step["q"], step["k_cache"], step["v_cache"], step["out"], meta, step["scale"])
    assert meta.cpu_plan is plan
