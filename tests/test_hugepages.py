"""The CPU KV cache is allocated on transparent huge pages (hugepages.zeros): zeroed, of the shape
and dtype asked, on a 2 MiB boundary, and its memory advised for huge pages (the kernel's
THPeligible flag in /proc/self/smaps), in the engine as well."""
import pytest
import torch

from inflight import EngineConfig, LLMEngine, hugepages


def thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    entry, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = start <= address < end
            elif inside:
                key, value = line.split(":", 1)
                entry[key] = value.strip()
    return entry


def test_zeros_is_zeroed_aligned_and_of_the_shape_asked():
    t = hugepages.zeros((1100, 16, 2, 64), torch.bfloat16)      # 4.3 MiB
    assert t.shape == (1100, 16, 2, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert not t.any()
    small = hugepages.zeros((3, 5), torch.float32)      # under a huge page: torch.zeros
    assert small.shape == (3, 5) and small.dtype == torch.float32 and not small.any()


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="no transparent huge pages on this kernel")
def test_the_engines_kv_cache_is_advised_for_huge_pages(tiny_checkpoint):
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(dtype="float32", num_kv_blocks=2048))
    k_cache, v_cache = engine.runner.kv_caches[0]
    nbytes = k_cache.numel() * k_cache.element_size()
    assert nbytes >= hugepages.HUGE_PAGE, "the test needs a cache of at least one huge page per layer"
    for cache in (k_cache, v_cache):
        assert cache.data_ptr() % hugepages.HUGE_PAGE == 0
        assert smaps_entry(cache.data_ptr()).get("THPeligible") == "1"
