"""vLLM's runtime LoRA routes, served where this server runs with --allow-runtime-lora-updating
(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, vLLM's switch): POST /v1/load_lora_adapter
{"lora_name", "lora_path"} and POST /v1/unload_lora_adapter {"lora_name"}, with vLLM's replies.

Loading asks `llm` for one token with the adapter named by its path ("lora_name" + "lora_path",
which its engine reads with allow_runtime_lora_updating): the engine reads and checks the
directory, on Triton's host, and an adapter it cannot serve is refused with its reason. Then the
name is a model id, and each request naming it carries the path too, so that `llm` reads the
adapter again where it gave its row to another (max_cpu_loras) or Triton restarted. Unloading,
as vLLM's, takes the name off this server's list: its requests are then a 404, and `llm` lets the
adapter's row go when it needs it."""
from __future__ import annotations

from starlette.responses import Response

from .context import Context
from .errors import APIError
from .schemas import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from .triton import Prompt

ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
POOLING_MODEL = 'its engine\'s runner is "pooling"'        # `llm`'s refusal of generation on a pooling model


def allowed_by_environment(environ) -> bool:
    """vLLM's reading of VLLM_ALLOW_RUNTIME_LORA_UPDATING."""
    return environ.get(ENV, "0").strip().lower() in ("1", "true")


async def load_lora_adapter(body: LoadLoRAAdapterRequest, ctx: Context) -> Response:
    name, path, models = body.lora_name, body.lora_path, ctx.models
    async with models.changes:
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        if name == models.name:
            raise APIError(400, f"The lora adapter '{name}' conflicts with a served base model.", "lora_name")
        if name in models.lora_names:
            raise APIError(400, f"The lora adapter '{name}' is one of `llm`'s multi_lora.json adapters, loaded at "
                           "start-up: it cannot be loaded again from a path.", "lora_name")
        if name in models.loaded and not body.load_inplace:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                           "in place, set 'load_inplace' to True.", "lora_name")
        await _read_in_llm(ctx, {"lora_name": name, "lora_path": path})
        models.loaded[name] = path
    return Response(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, ctx: Context) -> Response:
    name, models = body.lora_name, ctx.models
    async with models.changes:
        if not name:
            raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        if name in models.loaded:
            del models.loaded[name]
        elif name in models.lora_names:
            models.lora_names.remove(name)
        else:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "NotFoundError")
    return Response(f"Success: LoRA adapter '{name}' removed successfully.")


async def _read_in_llm(ctx: Context, adapter: dict) -> None:
    """One token with the adapter (an embedding where `llm` runs a pooling model): `llm` reads the
    directory where its engine has not, and refuses an adapter it cannot serve."""
    tokenizer = ctx.tokenizer
    token = next((t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id) if t is not None), 0)
    try:
        try:
            async for _ in ctx.triton.generate(Prompt([token]), {"max_tokens": 1, **adapter}):
                pass
        except APIError as exc:
            if POOLING_MODEL not in exc.message:
                raise
            await ctx.triton.embed([token], {}, None, None, adapter)
    except APIError as exc:
        # vLLM's status and words for a directory that is not there, or holds no adapter_config.json
        if "does not exist" in exc.message or "no adapter_config.json" in exc.message:
            raise APIError(404, f"Loading lora {adapter['lora_name']} failed: No adapter found for "
                           f"{adapter['lora_path']}", "lora_path", "NotFoundError") from None
        raise APIError(exc.status, exc.message, "lora_path", exc.code) from None
