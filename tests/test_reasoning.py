"""Reasoning models (vLLM's reasoning_parser): the engine's structured outputs wait for the end of
the model's reasoning, and the OpenAI server's --reasoning-parser splits a reply into reasoning and
content, streamed or not. The model: the test model with DeepSeek-R1's markers in its tokenizer."""
import dataclasses
import json
import re

import pytest

from inflight import EngineConfig, LLMEngine, SamplingParams

from .conftest import DEFAULT_MODEL, TEST_ENGINE
from .helpers import mistral_checkpoint, reasoning_checkpoint

AB = "[ab]{5}"


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    return reasoning_checkpoint(str(tmp_path_factory.mktemp("reasoning") / "think-tiny"))


@pytest.fixture(scope="module")
def think_tokenizer(think_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(think_model)


@pytest.fixture(scope="module")
def thinking_engine(think_model):
    return LLMEngine.from_pretrained(think_model, EngineConfig(**TEST_ENGINE, reasoning_parser="deepseek_r1"))


def constrained(seed: int, end: int, bias: float = 8.0) -> SamplingParams:
    """A regex the reasoning never meets, and a bias that makes the model end its reasoning soon."""
    return SamplingParams(max_tokens=40, temperature=1.0, seed=seed, logit_bias={end: bias},
                          structured_outputs={"regex": AB})


def test_a_grammar_waits_for_the_end_of_reasoning(thinking_engine, think_tokenizer):
    """As vLLM's engine with a reasoning parser: text before </think> is free (the regex would
    refuse it, and </think> itself), the answer after it follows the grammar."""
    end = think_tokenizer.convert_tokens_to_ids("</think>")
    prompt = think_tokenizer.encode("What is 2+2? <think>\n")
    outs = thinking_engine.generate([prompt] * 8, [constrained(seed, end) for seed in range(8)])
    ended = [out for out in outs if end in out.token_ids]
    assert ended and any(out.token_ids.index(end) > 0 for out in ended), "some reasoning before the end marker"
    for out in ended:
        at = out.token_ids.index(end)
        assert not re.fullmatch("[ab]*", think_tokenizer.decode(out.token_ids[:at])) or at == 0
        answer = think_tokenizer.decode(out.token_ids[at + 1:], skip_special_tokens=True)
        assert re.fullmatch(AB, answer) and out.finish_reason == "stop", answer
    for out in outs:
        if end not in out.token_ids:    # reasoned to its end (max_tokens or EOS): never constrained
            assert not re.fullmatch(AB, think_tokenizer.decode(out.token_ids, skip_special_tokens=True))
    assert thinking_engine.kv.num_free_blocks == thinking_engine.kv.num_blocks


def test_a_prompt_that_ended_the_reasoning_is_constrained_from_the_first_token(thinking_engine, think_tokenizer,
                                                                              think_model):
    """</think> as the prompt's last marker: the grammar starts at once (the bias cannot bring the
    marker in), as it does in an engine without a reasoning parser."""
    end = think_tokenizer.convert_tokens_to_ids("</think>")
    prompt = think_tokenizer.encode("What is 2+2? <think>\nfour</think>\n")
    outs = thinking_engine.generate([prompt] * 4, [constrained(seed, end, 100.0) for seed in range(4)])
    plain = LLMEngine.from_pretrained(think_model, EngineConfig(**TEST_ENGINE)).generate(
        [think_tokenizer.encode("What is 2+2? <think>\n")] * 4, [constrained(seed, end, 100.0) for seed in range(4)])
    # the reasoning given as ended (vLLM's engine's reasoning_ended) after a prompt that left it open
    ended = thinking_engine.generate([think_tokenizer.encode("What is 2+2? <think>\n")] * 4, [
        dataclasses.replace(constrained(seed, end, 100.0), reasoning_ended=True) for seed in range(4)])
    for out in outs + plain + ended:
        assert end not in out.token_ids
        assert re.fullmatch(AB, think_tokenizer.decode(out.token_ids, skip_special_tokens=True))


def test_a_thinking_token_budget_forces_the_end_marker(thinking_engine, think_tokenizer, think_model):
    """vLLM's thinking_token_budget: once the model has written that many tokens after <think> (the
    prompt's count), </think> is the only token it may take; then it goes on as it likes, and a
    constraint starts after it. Counting begins at a start marker: a prompt without one bounds nothing."""
    end = think_tokenizer.convert_tokens_to_ids("</think>")
    opened = think_tokenizer.encode("What is 2+2? <think>\n")
    after_start = len(opened) - 1 - opened.index(think_tokenizer.convert_tokens_to_ids("<think>"))
    for budget in (0, 3, 6):
        out = thinking_engine.generate([opened], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                               thinking_token_budget=budget))[0]
        assert out.token_ids.index(end) == max(budget - after_start, 0), (budget, out.token_ids)
        assert out.token_ids.count(end) == 1 and len(out.token_ids) == 12, "the model goes on after it"
    free = thinking_engine.generate([opened], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert end not in free.token_ids, "no budget: the tiny model never ends its reasoning"
    unopened = think_tokenizer.encode("What is 2+2?")
    out = thinking_engine.generate([unopened], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                              thinking_token_budget=0))[0]
    assert end not in out.token_ids
    constrained = thinking_engine.generate([opened], SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, thinking_token_budget=4, structured_outputs={"regex": AB}))[0]
    at = constrained.token_ids.index(end)
    assert at == 4 - after_start and re.fullmatch(AB, think_tokenizer.decode(constrained.token_ids[at + 1:],
                                                                             skip_special_tokens=True))
    assert thinking_engine.num_budgeted == 0 and thinking_engine.kv.num_free_blocks == thinking_engine.kv.num_blocks
    with pytest.raises(ValueError, match="'thinking_token_budget' needs the engine's reasoning_parser"):
        LLMEngine.from_pretrained(think_model, EngineConfig(**TEST_ENGINE)).add_request(
            "r", opened, SamplingParams(thinking_token_budget=3))
    with pytest.raises(ValueError, match="'thinking_token_budget' must be an integer >= 0, or -1 for none"):
        SamplingParams(thinking_token_budget=-2)


QWEN3_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>")
# Qwen3's shape: ChatML turns, and an earlier reply's reasoning rendered in the history
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>\n"
          "{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": "Checking.", "reasoning": "Call the tool."},
           {"role": "tool", "content": "12 C"}]


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    model = reasoning_checkpoint(str(tmp_path_factory.mktemp("qwen3") / "qwen3-think"), QWEN3_MARKERS, CHATML)
    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def qwen3_engine(qwen3_tokenizer):
    config = EngineConfig(**TEST_ENGINE, reasoning_parser="qwen3")
    return LLMEngine.from_pretrained(qwen3_tokenizer.name_or_path, config)


def test_qwen3_reads_the_prompts_markers_from_its_last_turn(qwen3_engine, qwen3_tokenizer):
    """vLLM 0.32's qwen3: the history's </think> (an earlier reply's reasoning, sent back as vLLM's
    `reasoning` and rendered by the template) belongs to another turn, so the new reply reasons
    first and its grammar waits; deepseek_r1 reads the last marker wherever it is."""
    from inflight.reasoning import Reasoning
    from inflight_client.openai_server.chat_template import ChatTemplate
    from inflight_client.openai_server.schemas import ChatCompletionRequest
    body = ChatCompletionRequest(model="m", messages=HISTORY)
    prompt = ChatTemplate(qwen3_tokenizer).render(body.messages, None, body)
    assert "<think>\nCall the tool.\n</think>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    ids = qwen3_tokenizer.encode(prompt)
    assert Reasoning.load("qwen3", qwen3_tokenizer).open_after(ids)
    assert not Reasoning.load("deepseek_r1", qwen3_tokenizer).open_after(ids)
    end = qwen3_tokenizer.convert_tokens_to_ids("</think>")
    outs = qwen3_engine.generate([ids] * 6, [constrained(seed, end) for seed in range(6)])
    ended = [out for out in outs if end in out.token_ids]
    assert any(out.token_ids.index(end) > 0 for out in ended), "free reasoning before the end marker"
    for out in ended:
        answer = qwen3_tokenizer.decode(out.token_ids[out.token_ids.index(end) + 1:], skip_special_tokens=True)
        assert re.fullmatch(AB, answer), answer


def call_tag(**options) -> dict:
    """Hermes' call envelope (vLLM's tag for Qwen3's calls): a <tool_call> opens a call of f."""
    call = {"type": "tag", "begin": '<tool_call>\n{"name": "f", "arguments": ', "end": "}\n</tool_call>",
            "content": {"type": "json_schema", "json_schema": {"type": "object", "properties": {
                "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [call]}}
    return {"structural_tag": json.dumps(tag), "disable_any_whitespace": True, **options}


def test_a_tool_call_opened_in_qwen3s_reasoning_ends_it_and_starts_the_grammar(qwen3_engine, qwen3_tokenizer):
    """vLLM 0.32's qwen3: <tool_call> written before </think> ends the reasoning and is the grammar's
    first token, so the call is written under the tag. Where the grammar cannot start with it (a
    regex), the wait goes on to </think>, the request is not failed, and the answer follows it."""
    tool, end = qwen3_tokenizer.convert_tokens_to_ids(["<tool_call>", "</think>"])
    prompt = qwen3_tokenizer.encode("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>\n")
    calls = qwen3_engine.generate([prompt] * 4, [SamplingParams(
        max_tokens=40, temperature=1.0, seed=seed, logit_bias={tool: 6.0},
        structured_outputs=call_tag()) for seed in range(4)])
    opened = [qwen3_tokenizer.decode(out.token_ids[out.token_ids.index(tool):]) for out in calls
              if tool in out.token_ids and end not in out.token_ids[:out.token_ids.index(tool)]]
    assert any("</tool_call>" in text for text in opened), "some replies open a call while reasoning"
    for text in opened:
        assert text.startswith('<tool_call>\n{"name": "f", "arguments": '), text
        if "</tool_call>" in text:
            call = json.loads(text[len("<tool_call>\n"):text.index("\n</tool_call>")])
            assert call["name"] == "f" and isinstance(call["arguments"]["a"], int), text
    answers = qwen3_engine.generate([prompt] * 6, [SamplingParams(
        max_tokens=40, temperature=1.0, seed=seed, logit_bias={tool: 9.0, end: 9.0},
        structured_outputs={"regex": AB}) for seed in range(6)])
    assert any(tool in out.token_ids[:out.token_ids.index(end)] for out in answers if end in out.token_ids)
    for out in answers:
        assert out.finish_reason != "error"
        if end in out.token_ids:
            answer = qwen3_tokenizer.decode(out.token_ids[out.token_ids.index(end) + 1:], skip_special_tokens=True)
            assert re.fullmatch(AB if out.finish_reason == "stop" else "[ab]{0,5}", answer), answer
    assert qwen3_engine.kv.num_free_blocks == qwen3_engine.kv.num_blocks


def read(reader, text: str, cuts: list[int]) -> tuple[str, str]:
    """The reasoning and content a reader gives for the text fed in pieces cut at these offsets."""
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    split = [reader.feed(piece) for piece in pieces] + [reader.close()]
    return "".join(r for r, _ in split), "".join(c for _, c in split)


def test_qwen3s_reader_ends_the_reasoning_at_a_tool_call_and_drops_repeated_markers(qwen3_tokenizer):
    """The OpenAI server's split, as vLLM 0.32's qwen3 reads: <tool_call> ends the reasoning and
    begins the content (where the tool parser finds the call), a <think> inside the reasoning and a
    </think> after it are none; deepseek_r1 reads on to </think>. The same for the text cut anywhere."""
    from inflight.reasoning import Reasoning
    from inflight_client.openai_server.reasoning import ReasoningText
    text = '<think>\nplan<think>a<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call></think>ok'
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    expected = {"qwen3": ("\nplana", call + "ok"), "deepseek_r1": ("\nplan<think>a" + call, "ok")}
    for parser, split in expected.items():
        markers = Reasoning.load(parser, qwen3_tokenizer)
        for cut in range(len(text) + 1):
            for cuts in ([cut], list(range(cut, len(text), 3))):
                assert read(ReasoningText(markers, True), text, cuts) == split, (parser, cuts)
        tail = "<think>plan</think>a </th"      # content that ends as a marker could begin: given at the end
        assert read(ReasoningText(markers, True), tail, [len(tail) - 2]) == ("plan", "a </th"), parser


def test_a_qwen3_tool_call_ends_the_reasoning_count_and_the_budget(qwen3_tokenizer):
    """usage's reasoning_tokens and thinking_token_budget end where the split does, at <tool_call>."""
    from inflight.reasoning import Reasoning, ReasoningTokens
    tool, end = qwen3_tokenizer.convert_tokens_to_ids(["<tool_call>", "</think>"])
    for parser, counted in (("qwen3", 2), ("deepseek_r1", 4)):
        markers = Reasoning.load(parser, qwen3_tokenizer)
        count = ReasoningTokens(markers, open=True)
        for token in (5, 6, tool, 7, end, 8):
            count.add(token)
        assert count.count == counted, parser
        assert (markers.budget_after(3, tool, 10) is None) == (parser == "qwen3")


# a reply -> (reasoning, content) as vLLM 0.32's mistral parser reads it (checked against it offline)
MISTRAL_REPLIES = {
    "plain answer": (None, "plain answer"),                           # no [THINK]: all content
    "[THINK]plan  \n[/THINK] answer": ("plan", " answer"),           # the reasoning's trailing whitespace dropped
    "pre[THINK]plan[/THINK]ans": ("plan", "preans"),                   # content before the reasoning
    "[THINK]a[THINK]b[/THINK]c[/THINK]d": ("ab", "cd"),                # a repeated start, a stray end: none
    "[THINK]a  [/THINK]b[THINK]c \n": ("a  c", "b"),                  # reasoning again, never ended
    "x[/THINK]y": (None, "xy"),
    "[THINK]p[TOOL_CALLS]f[ARGS]{}[/THINK]": ("p", "[TOOL_CALLS]f[ARGS]{}"),    # a call ends the reasoning
    "[THINK] [/THINK]</s>x<s>": (None, "x"),                           # other special tokens dropped
    "[THINK]a</s[/THINK]b</": ("a</s", "b</"),
}


@pytest.fixture(scope="module")
def mistral_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(mistral_checkpoint(str(tmp_path_factory.mktemp("magistral") / "m"),
                                                            think=True))


def test_mistrals_reader_splits_as_vllm_whole_or_streamed_in_any_pieces(mistral_tokenizer):
    """--reasoning-parser mistral: the reply starts in the content whatever the prompt holds (its
    [/THINK] here), [THINK] opens the reasoning wherever it comes; the same for the text cut
    anywhere; the reasoning tokens counted from the ids are those of the split's reasoning."""
    from inflight.reasoning import Reasoning, ReasoningTokens
    from inflight_client.openai_server.reasoning import reader
    markers = Reasoning.load("mistral", mistral_tokenizer)
    prompt = mistral_tokenizer("System: [THINK]x[/THINK]\nUser: hi", add_special_tokens=False)["input_ids"]
    assert markers.end_id in prompt and not markers.open_after(prompt)
    for text, (reasoning, content) in MISTRAL_REPLIES.items():
        assert reader(markers, prompt).split(text) == (reasoning, content), text
        for cut in range(len(text) + 1):
            for cuts in ([cut], list(range(cut, len(text), 3))):
                assert read(reader(markers, prompt), text, cuts) == (reasoning or "", content), (text, cuts)
    start, end, eos = markers.start_id, markers.end_id, mistral_tokenizer.eos_token_id
    count = ReasoningTokens(markers, markers.reply_opens(prompt))
    for token in [5, start, 6, 7, start, 8, eos, end, 9, start, 10]:      # reasoning: 6, 7, 8 and 10
        count.add(token)
    assert count.count == 4


def test_mistral_without_think_in_the_tokenizer_reads_no_reasoning(tmp_path):
    """As vLLM's parser: a tokenizer without [THINK] has no reasoning (all content, a constraint
    from the first token, no thinking_token_budget); one without [TOOL_CALLS] is refused."""
    from inflight.reasoning import Reasoning
    from inflight_client.openai_server.reasoning import reader
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(mistral_checkpoint(str(tmp_path / "m")))
    markers = Reasoning.load("mistral", tokenizer)
    assert not markers.open_after([1, 2]) and reader(markers, []).split("[THINK]a[/THINK]b") == (
        None, "[THINK]a[/THINK]b")
    engine = LLMEngine.from_pretrained(str(tmp_path / "m"), EngineConfig(**TEST_ENGINE, reasoning_parser="mistral"))
    with pytest.raises(ValueError, match="'thinking_token_budget' needs .* the tokenizer has none"):
        engine.add_request("r", [1, 2], SamplingParams(max_tokens=2, thinking_token_budget=1))
    with pytest.raises(ValueError, match="'reasoning_parser' 'mistral': the tokenizer has no '\\[TOOL_CALLS\\]'"):
        Reasoning.load("mistral", AutoTokenizer.from_pretrained(DEFAULT_MODEL))


def test_the_reasoning_parser_is_checked_at_start():
    with pytest.raises(ValueError, match="'reasoning_parser' must be one of"):
        EngineConfig(reasoning_parser="deepseek")
    assert EngineConfig(reasoning_parser="").reasoning_parser is None       # vLLM's default, written out
    with pytest.raises(ValueError, match="'reasoning_parser' 'deepseek_r1': the tokenizer has no '<think>' token"):
        LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(**TEST_ENGINE, reasoning_parser="deepseek_r1"))


@pytest.fixture(scope="module")
def think_triton(think_model, tmp_path_factory):
    """tritonserver serving the reasoning model with the engine's reasoning_parser: (repository, server)."""
    from inflight.serving import launch
    root = tmp_path_factory.mktemp("reasoning-serve")
    repo = launch.make_repository(str(root / "repository"), think_model,
                                  {**TEST_ENGINE, "reasoning_parser": "deepseek_r1"})
    with launch.ServerProcess(repo) as server:
        yield repo, server


@pytest.fixture(scope="module")
def think_client(think_triton):
    """The OpenAI server as `make serve` starts it next to think_triton (which passes the same
    --reasoning-parser)."""
    import openai
    from inflight.serving import launch
    repo, server = think_triton
    children = launch.Children()
    flags = ("--disable-any-whitespace", "--enable-auto-tool-choice", "--tool-call-parser=hermes")
    endpoints = launch.Endpoints(server.http_port, server.grpc_port, server.metrics_port,
                                 openai_port=launch.free_ports(1)[0], openai_args=flags)
    assert launch.start_openai_server(children, repo, endpoints)
    try:
        yield openai.OpenAI(base_url=f"http://localhost:{endpoints.openai_port}/v1", api_key="-", max_retries=0)
    finally:
        for process in children.processes:
            process.terminate()
            process.wait(30)


SHIRT = {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]}}, "required": ["size"]}


def test_a_reply_comes_as_its_reasoning_and_its_content_streamed_or_not(think_client, think_tokenizer):
    """vLLM's `reasoning` beside `content`: the reasoning is free, the content after </think> holds
    the response_format; a stream's reasoning and content deltas add up to the whole reply, and
    include_reasoning false leaves the reasoning out."""
    import jsonschema
    end = think_tokenizer.convert_tokens_to_ids("</think>")
    split = 0
    for seed in range(8):
        kwargs = dict(model="think-tiny", messages=[{"role": "user", "content": "Which size?"}], max_tokens=40,
                      temperature=1.0, seed=seed, logit_bias={str(end): 8},
                      response_format={"type": "json_schema", "json_schema": {"name": "shirt", "schema": SHIRT}})
        message = think_client.chat.completions.create(**kwargs).choices[0].message
        reasoning = message.model_extra["reasoning"]
        if message.content is not None:           # the model ended its reasoning: the answer is constrained
            jsonschema.validate(json.loads(message.content), SHIRT)
            split += bool(reasoning)
        assert reasoning is None or "</think>" not in reasoning
        chunks = list(think_client.chat.completions.create(stream=True, **kwargs))
        streamed = ["".join((c.choices[0].delta.model_extra or {}).get(field) or "" for c in chunks if c.choices)
                    for field in ("reasoning",)] + ["".join(c.choices[0].delta.content or "" for c in chunks)]
        assert streamed == [reasoning or "", message.content or ""]
        hidden = think_client.chat.completions.create(**kwargs, extra_body={"include_reasoning": False})
        assert hidden.choices[0].message.model_extra["reasoning"] is None
        assert hidden.choices[0].message.content == message.content
    assert split, "some replies reason, then answer"


def test_qwen3_with_thinking_off_reads_no_reasoning_and_constrains_from_the_first_token(think_triton, think_model,
                                                                                        tmp_path):
    """vLLM's qwen3 with chat_template_kwargs' enable_thinking false: the whole reply is content and a
    constraint holds from its first token (the server sends `llm` reasoning_ended), whatever the
    template made of the flag: this one ignores it and opens <think>, where the engine's deepseek_r1
    waits for </think>, as it still does with thinking on."""
    import jsonschema
    import openai
    from inflight_client.openai_server.process import OpenAIServerProcess
    from .helpers import SOURCE_PATH_ENV
    _, server = think_triton
    flags = ["--reasoning-parser", "qwen3", "--disable-any-whitespace"]
    with OpenAIServerProcess(server.http_url, think_model, extra=flags, env=SOURCE_PATH_ENV,
                             log_path=str(tmp_path / "openai.log")) as api:
        client = openai.OpenAI(base_url=api.base_url, api_key="-", max_retries=0)
        kwargs = dict(model="think-tiny", messages=[{"role": "user", "content": "Which size?"}], max_tokens=30,
                      temperature=1.0, response_format={"type": "json_schema",
                                                        "json_schema": {"name": "shirt", "schema": SHIRT}})
        for seed in range(3):
            reply = client.chat.completions.create(seed=seed, **kwargs, extra_body={
                "chat_template_kwargs": {"enable_thinking": False}})
            off = reply.choices[0].message
            assert off.model_extra["reasoning"] is None and reply.usage.completion_tokens_details.reasoning_tokens == 0
            jsonschema.validate(json.loads(off.content), SHIRT)
            chunks = list(client.chat.completions.create(seed=seed, stream=True, **kwargs, extra_body={
                "chat_template_kwargs": {"enable_thinking": False}}))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == off.content
        # beam search's own count (its steps' tokens) reads the reply as llm does
        beams = client.chat.completions.create(model="think-tiny", messages=kwargs["messages"], n=2, max_tokens=4,
                                               extra_body={"use_beam_search": True,
                                                           "chat_template_kwargs": {"enable_thinking": False}})
        assert beams.choices[1].message.content and beams.usage.completion_tokens_details.reasoning_tokens == 0
        on = client.chat.completions.create(seed=0, **kwargs)
        assert on.choices[0].message.model_extra["reasoning"], "with thinking on the reply reasons first, unconstrained"
        assert on.usage.completion_tokens_details.reasoning_tokens > 0


def test_include_reasoning_false_leaks_no_reasoning_tokens(think_client, think_tokenizer):
    """As vLLM: the hidden reasoning's tokens are not in logprobs nor in token_ids either, whole or
    streamed (a stream sends no chunk for them)."""
    end = think_tokenizer.convert_tokens_to_ids("</think>")
    kwargs = dict(model="think-tiny", messages=[{"role": "user", "content": "Which size?"}], max_tokens=30,
                  temperature=0, logit_bias={str(end): 6}, logprobs=True, top_logprobs=1)
    shown = think_client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True}).choices[0]
    assert shown.message.model_extra["reasoning"] and shown.logprobs.content and shown.model_extra["token_ids"]
    hidden = think_client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True,
                                                                       "include_reasoning": False}).choices[0]
    assert hidden.message.model_extra["reasoning"] is None and hidden.logprobs is None
    assert hidden.model_extra["token_ids"] is None
    chunks = list(think_client.chat.completions.create(stream=True, **kwargs, extra_body={
        "return_token_ids": True, "include_reasoning": False}))
    assert all(c.choices[0].logprobs is None and not (c.choices[0].model_extra or {}).get("token_ids")
               for c in chunks if c.choices)
    assert len(chunks) == 2 + bool(hidden.message.content), "the role, any content, the end"


def test_thinking_token_budget_reaches_llm_from_the_openai_server(think_client, think_tokenizer):
    end = think_tokenizer.convert_tokens_to_ids("</think>")
    reply = think_client.completions.create(model="think-tiny", prompt="What is 2+2? <think>\n", max_tokens=8,
                                            temperature=0, extra_body={"thinking_token_budget": 3, "ignore_eos": True,
                                                                       "return_token_ids": True})
    assert reply.choices[0].model_extra["token_ids"][2] == end and "</think>" in reply.choices[0].text
    import openai
    with pytest.raises(openai.BadRequestError) as error:
        think_client.completions.create(model="think-tiny", prompt="x", extra_body={"thinking_token_budget": -2})
    assert error.value.body["param"] == "thinking_token_budget"


def test_reasoning_and_content_as_vllm_writes_them_at_the_edges(think_client, think_tokenizer):
    """A reply that ends its reasoning at once has reasoning "" (vLLM's); one that never ends it has
    content null, with tools given too."""
    end = think_tokenizer.convert_tokens_to_ids("</think>")
    kwargs = dict(model="think-tiny", messages=[{"role": "user", "content": "Which size?"}], max_tokens=6,
                  temperature=0)
    at_once = think_client.chat.completions.create(**kwargs, logit_bias={str(end): 100}).choices[0].message
    assert at_once.model_extra["reasoning"] == "" and at_once.content.startswith("</think>")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for extra in ({}, {"tools": [tool]}):         # tool_choice "auto": the parser reads the (empty) content
        never = think_client.chat.completions.create(**kwargs, **extra).choices[0].message
        assert never.model_extra["reasoning"] and never.content is None, extra


def test_usage_counts_the_reasoning_tokens_whole_and_streamed(think_client, think_tokenizer):
    """usage.completion_tokens_details.reasoning_tokens (vLLM's and OpenAI's): the tokens each choice
    wrote before </think> (the template opened the reasoning; the marker is not counted), all of them
    where it never ends; the same in a stream's usage, per choice with continuous usage, and with
    include_reasoning false. Completions have none."""
    start, end = think_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    counts = []
    for seed in range(3):
        kwargs = dict(model="think-tiny", messages=[{"role": "user", "content": "Which size?"}], max_tokens=24,
                      temperature=1.0, seed=seed, n=2, logit_bias={str(end): 6, str(start): -100})
        reply = think_client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True,
                                                                          "ignore_eos": True})
        before_end = [ids.index(end) if end in ids else len(ids)
                      for ids in (choice.model_extra["token_ids"] for choice in reply.choices)]
        assert reply.usage.completion_tokens_details.reasoning_tokens == sum(before_end)
        counts += before_end
        hidden = think_client.chat.completions.create(**kwargs, extra_body={"include_reasoning": False,
                                                                           "ignore_eos": True})
        assert hidden.usage.completion_tokens_details.reasoning_tokens == sum(before_end)
        chunks = list(think_client.chat.completions.create(
            stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kwargs,
            extra_body={"ignore_eos": True}))
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == sum(before_end)
        for index in range(2):
            last = [c for c in chunks if c.choices and c.choices[0].index == index][-1]
            assert last.usage.completion_tokens_details.reasoning_tokens == before_end[index]
    assert any(0 < count < 24 for count in counts) and 24 in counts, counts    # ended and never ended
    text = think_client.completions.create(model="think-tiny", prompt="<think> x", max_tokens=4)
    assert text.usage.completion_tokens_details is None


def test_beam_search_counts_the_reasoning_tokens(think_client, think_tokenizer):
    """A chat's beam search (the OpenAI server's, over `llm` steps of one token) splits each choice
    and counts its reasoning tokens as `llm` counts a sampled reply's."""
    end = think_tokenizer.convert_tokens_to_ids("</think>")
    reply = think_client.chat.completions.create(
        model="think-tiny", messages=[{"role": "user", "content": "Which size?"}], max_tokens=12, n=2,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True})
    ids = [choice.model_extra["token_ids"] for choice in reply.choices]
    before_end = [tokens.index(end) if end in tokens else len(tokens) for tokens in ids]
    assert reply.usage.completion_tokens_details.reasoning_tokens == sum(before_end) > 0
    assert all(choice.message.model_extra["reasoning"] for choice in reply.choices)


def test_the_openai_server_needs_the_markers_in_the_tokenizer(tmp_path):
    import subprocess
    import sys

    from .helpers import SOURCE_PATH_ENV
    run = subprocess.run([sys.executable, "-m", "inflight_client.openai_server", "--model-dir", DEFAULT_MODEL,
                          "--reasoning-parser", "deepseek_r1", "--port", "1"], capture_output=True, text=True,
                         env={**__import__("os").environ, **SOURCE_PATH_ENV}, timeout=120)
    assert run.returncode != 0
    assert "--reasoning-parser: 'reasoning_parser' 'deepseek_r1': the tokenizer has no '<think>' token" in run.stderr
