"""A model's tokenizer reads prompts as the model's engine does: its BOS on completion prompts,
its own chat template (from ``tokenizer_config.json``) on chats, special tokens in the rendered
text as special. Without that, every key the door looks up differs from the keys the engine's
KV events registered (found in the thirtieth session: the door added no BOS and always used
ChatML, so a Llama-style model's prompts could never hit)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer as HF
from tokenizers import processors

from kvcompass.engine.chat_template import ChatTemplate, load_chat_templates
from kvcompass.engine.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from kvcompass.errors import InvalidArgumentError

BOS, HEAD, END_HEAD, EOT = "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
# The shape of Llama 3's template: the BOS, an optional tools block, each message under a
# header, the assistant's header as the generation prompt.
TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools is not none %}{{- '" + HEAD + "system" + END_HEAD + "\\n\\nTools: ' + tools | tojson + '" + EOT + "' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'forbidden' %}{{- raise_exception('no forbidden role') }}{%- endif %}"
    "{{- '" + HEAD + "' + message['role'] + '" + END_HEAD + "\\n\\n' + message['content'] | trim + '" + EOT + "' }}"
    "{%- if message.tool_calls is defined %}{{- message.tool_calls[0].function.arguments | tojson }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '" + HEAD + "assistant" + END_HEAD + "\\n\\n' }}{%- endif %}"
)


def model_dir(tmp_path: Path, template: Any = TEMPLATE) -> Path:
    """A model's tokenizer files: the built-in BPE with Llama-style special tokens, a
    post-processor that puts the BOS first, and a tokenizer_config.json with the template."""
    hf = HF.from_file(str(DEFAULT_TOKENIZER_PATH))
    hf.add_special_tokens([BOS, HEAD, END_HEAD, EOT])
    hf.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, hf.token_to_id(BOS))])
    hf.save(str(tmp_path / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": {"content": BOS}, "eos_token": EOT}
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path / "tokenizer.json"


def engine_ids(path: Path, text: str, add_special_tokens: bool) -> list[int]:
    """What vLLM computes: the HF tokenizer as loaded (special tokens in text are special)."""
    return list(HF.from_file(str(path)).encode(text, add_special_tokens=add_special_tokens).ids)


def test_a_completion_prompt_gets_the_models_bos_and_its_special_tokens(tmp_path: Path) -> None:
    path = model_dir(tmp_path)
    tok = load_tokenizer(path)
    text = "The quick brown fox" + EOT + "jumps"
    ids = tok.encode_prompt(text).tolist()
    assert ids == engine_ids(path, text, True)
    assert ids[0] == tok.token_id(BOS) and tok.token_id(EOT) in ids
    assert tok.encode(text).tolist()[0] != tok.token_id(BOS)  # encode() is the raw text's, unchanged


def test_a_chat_is_rendered_by_the_models_template_and_read_as_the_engine_reads_it(tmp_path: Path) -> None:
    path = model_dir(tmp_path)
    tok = load_tokenizer(path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "there"}]}]
    text = f"{BOS}{HEAD}system{END_HEAD}\n\nBe brief.{EOT}{HEAD}user{END_HEAD}\n\nHi\nthere{EOT}{HEAD}assistant{END_HEAD}\n\n"
    ids = tok.apply_chat_template(messages).tolist()
    assert ids == engine_ids(path, text, False)
    assert ids.count(tok.token_id(HEAD)) == 3 and ids[0] == tok.token_id(BOS)  # specials are one id each
    # The turn's prompt is a prefix of the next turn's (the history is resent), as the engine's.
    longer = tok.apply_chat_template([*messages, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"}]).tolist()
    assert longer[: len(ids) - 4] == ids[:-4]
    assert tok.apply_chat_template(messages, add_generation_prompt=False).tolist() == engine_ids(path, text.removesuffix(f"{HEAD}assistant{END_HEAD}\n\n"), False)


def test_tools_are_rendered_and_tool_call_arguments_are_objects(tmp_path: Path) -> None:
    tok = load_tokenizer(model_dir(tmp_path))
    messages = [{"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = tok.apply_chat_template(messages, tools).tolist()
    assert with_tools != tok.apply_chat_template(messages).tolist()
    assert "get_weather" in tok.decode(with_tools)
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}]}
    rendered = ChatTemplate(TEMPLATE, {"bos_token": BOS}).render([call])
    assert '{"city": "Oslo"}' in rendered  # an object tojson'ed, not a string quoted twice


def test_a_template_that_refuses_is_a_clear_error(tmp_path: Path) -> None:
    tok = load_tokenizer(model_dir(tmp_path))
    with pytest.raises(InvalidArgumentError, match="refused the messages: no forbidden role"):
        tok.apply_chat_template([{"role": "forbidden", "content": "x"}])
    with pytest.raises(InvalidArgumentError, match="not a valid Jinja template"):
        ChatTemplate("{% for %}")
    with pytest.raises(InvalidArgumentError, match="tools must be a list"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], "get_weather")


def test_configs_without_a_template_keep_chatml_and_named_templates_are_read(tmp_path: Path) -> None:
    for sub in ("a", "b", "c"):
        (tmp_path / sub).mkdir()
    assert load_tokenizer(model_dir(tmp_path / "a", template=None)).chat_templates is None
    named = load_tokenizer(model_dir(tmp_path / "b", template=[{"name": "tool_use", "template": "TOOLS{{ tools | length }}"}, {"name": "default", "template": TEMPLATE}]))
    assert named.chat_templates is not None
    hello = [{"role": "user", "content": "hello"}]
    assert named.decode(named.apply_chat_template(hello, [{"type": "function", "function": {"name": "f"}}]).tolist()) == "TOOLS1"  # tools: tool_use
    assert "hello" in named.decode(named.apply_chat_template(hello).tolist())  # no tools: default
    bad = tmp_path / "c"
    bad.mkdir(exist_ok=True)
    (bad / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="cannot be read as JSON"):
        load_chat_templates(bad)


def test_the_built_in_tokenizer_is_its_own_engines_and_unchanged() -> None:
    tok = load_tokenizer(None)
    text = "plain text <|im_start|> with a special token spelled"
    assert tok.chat_templates is None
    assert np.array_equal(tok.encode_prompt(text), tok.encode(text))


# -- against the reference ------------------------------------------------------------------------
# Reduced shapes of Llama 3.1's and Gemma 3's templates, and what transformers 5.25's
# render_jinja_template gives for each case once the messages and tools are normalised as vLLM
# normalises them (computed in the thirtieth session's review; the refusal part's text added by
# hand, as vLLM's chat_utils reads a refusal part's "refusal" field).
LLAMA31 = '{{- bos_token }}\n{%- if not tools is defined %}{%- set tools = none %}{%- endif %}\n{%- if messages[0][\'role\'] == \'system\' %}{%- set system_message = messages[0][\'content\']|trim %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}\n{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}\n{{- system_message }}{{- "<|eot_id|>" }}\n{%- if tools is not none %}\n{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}\n{%- endif %}\n{%- for message in messages %}\n    {%- if not (message.role == \'ipython\' or message.role == \'tool\' or \'tool_calls\' in message) %}\n        {{- \'<|start_header_id|>\' + message[\'role\'] + \'<|end_header_id|>\\n\\n\'+ message[\'content\'] | trim + \'<|eot_id|>\' }}\n    {%- elif \'tool_calls\' in message %}\n        {%- if not message.tool_calls|length == 1 %}{{- raise_exception("This model only supports single tool-calls at once!") }}{%- endif %}\n        {%- set tool_call = message.tool_calls[0].function %}\n        {{- \'<|start_header_id|>assistant<|end_header_id|>\\n\\n\' -}}\n        {{- \'{"name": "\' + tool_call.name + \'", \' }}{{- \'"parameters": \' }}{{- tool_call.arguments | tojson }}{{- "}" }}{{- "<|eot_id|>" }}\n    {%- elif message.role == "tool" or message.role == "ipython" %}\n        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}\n        {%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}\n        {{- "<|eot_id|>" }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}{{- \'<|start_header_id|>assistant<|end_header_id|>\\n\\n\' }}{%- endif %}'
GEMMA3 = "{{ bos_token }}{%- for message in messages -%}<start_of_turn>{{ message['role'] }}\n{%- if message['content'] is string -%}{{ message['content'] | trim }}{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}<end_of_turn>\n{% endfor -%}{%- if add_generation_prompt -%}<start_of_turn>model\n{%- endif -%}"
REFERENCE = [
    ('tools_no_description', 'llama', [{"role": "user", "content": "weather?"}], [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}], '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n<|eot_id|>{\n    "type": "function",\n    "function": {\n        "name": "get_weather",\n        "description": null,\n        "parameters": {\n            "type": "object"\n        }\n    }\n}\n\n<|start_header_id|>user<|end_header_id|>\n\nweather?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'),
    ('tools_key_order', 'llama', [{"role": "user", "content": "weather?"}], [{"function": {"description": "d", "name": "get_weather", "parameters": {"type": "object"}}, "type": "function"}], '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n<|eot_id|>{\n    "type": "function",\n    "function": {\n        "name": "get_weather",\n        "description": "d",\n        "parameters": {\n            "type": "object"\n        }\n    }\n}\n\n<|start_header_id|>user<|end_header_id|>\n\nweather?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'),
    ('empty_tool_calls', 'llama', [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "tool_calls": []}, {"role": "user", "content": "more"}], None, '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nhello<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nmore<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'),
    ('null_content', 'llama', [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "more"}], None, '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nmore<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'),
    ('bad_args', 'llama', [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}], None, '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n{"name": "f", "parameters": {}}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'),
    ('null_text_part', 'llama', [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": None}]}], None, '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\na<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'),
    ('refusal_part', 'llama', [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}, {"role": "user", "content": "x"}], None, '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nq<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nno<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nx<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'),
    ('gemma_two_parts', 'gemma', [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": " there"}]}], None, '<|begin_of_text|><start_of_turn>userHithere<end_of_turn>\n<start_of_turn>model'),
    ('gemma_image', 'gemma', [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "describe"}]}], None, '<|begin_of_text|><start_of_turn>user<start_of_image>describe<end_of_turn>\n<start_of_turn>model'),
    ('plain', 'llama', [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi"}], None, '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'),
]


@pytest.mark.parametrize(("case", "shape", "messages", "tools", "expected"), REFERENCE, ids=[c[0] for c in REFERENCE])
def test_the_render_matches_transformers_after_vllms_normalisation(case: str, shape: str, messages: Any, tools: Any, expected: str) -> None:
    """Tools rebuilt in vLLM's shape (key order, a null description), empty or unparsable tool
    calls, null content and null text parts, a refusal's text, and content as parts for a
    template that loops over it (Gemma's: parts kept apart, an image as its own part)."""
    template = ChatTemplate(LLAMA31 if shape == "llama" else GEMMA3, {"bos_token": "<|begin_of_text|>"})
    assert template.parts == (shape == "gemma")
    assert template.render(messages, tools=tools) == expected


def test_a_chat_template_jinja_file_wins_and_a_model_without_a_template_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """transformers reads ``chat_template.jinja`` before tokenizer_config.json's template; a
    model's tokenizer with neither keys chats as ChatML, and says so."""
    path = model_dir(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("JINJA{{ messages[0].content }}")
    tok = load_tokenizer(path)
    assert tok.decode(tok.apply_chat_template([{"role": "user", "content": "x"}]).tolist()) == "JINJAx"
    (tmp_path / "chat_template.jinja").unlink()
    none = tmp_path / "none"
    none.mkdir()
    model_dir(none, template=None)
    with caplog.at_level("WARNING"):
        assert load_tokenizer(none / "tokenizer.json").chat_templates is None
    assert "no chat template beside it" in caplog.text


def test_the_requests_own_fields_are_read_as_vllm_reads_them(tmp_path: Path) -> None:
    """``add_special_tokens`` on a completion (a client that rendered the prompt itself sends
    false: no second BOS), and a chat's ``continue_final_message``, ``chat_template_kwargs`` and
    ``add_special_tokens``."""
    import asyncio

    from kvcompass.services.openai_api import OpenAIError, request_tokens

    path = model_dir(tmp_path)
    tok = load_tokenizer(path)

    def tokens(body: dict[str, Any]) -> list[int]:
        chat = "messages" in body
        return asyncio.run(request_tokens(body, tok.encode_prompt, tok.apply_chat_template, chat=chat, batch=None))[0].tolist()

    rendered = f"{BOS}{HEAD}user{END_HEAD}\n\nhi{EOT}"
    assert tokens({"prompt": rendered, "add_special_tokens": False}) == engine_ids(path, rendered, False)
    assert tokens({"prompt": rendered}) == engine_ids(path, rendered, True)  # a second BOS, as vLLM adds
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    assert tokens({"messages": msgs, "continue_final_message": True, "add_generation_prompt": False}) == engine_ids(path, f"{rendered}{HEAD}assistant{END_HEAD}\n\nOnce upon", False)
    flag = load_tokenizer(model_dir(tmp_path / "k" if (tmp_path / "k").mkdir() is None else tmp_path, template="{{ 'ON' if enable_thinking else 'OFF' }}"))
    assert flag.decode(flag.apply_chat_template(msgs, None, {"chat_template_kwargs": {"enable_thinking": True}}).tolist()) == "ON"
    assert tokens({"messages": msgs[:1], "add_special_tokens": True})[:2] == [tok.token_id(BOS)] * 2  # the template's and the post-processor's
    for bad in ({"prompt": "x", "add_special_tokens": "no"}, {"messages": msgs, "chat_template_kwargs": [1]}, {"messages": msgs, "continue_final_message": True, "add_generation_prompt": True}):
        with pytest.raises(OpenAIError):
            tokens(bad)


# An operator's template, as one starts vLLM with --chat-template: the engine renders every chat
# with it, so the door must too (before, the door had no such option: its keys for chats under a
# flag-given template never matched what the engine registered).
OPERATOR = "{{- bos_token }}{%- for m in messages %}{{- '[' + m['role'] + '] ' + m['content'] + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '[assistant] ' }}{%- endif %}"


def test_an_operators_chat_template_replaces_the_models_for_every_request(tmp_path: Path) -> None:
    path = model_dir(tmp_path, template=[{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": TEMPLATE}])
    (tmp_path / "op.jinja").write_text(OPERATOR)
    hello = [{"role": "user", "content": "hello"}]
    expected = engine_ids(path, f"{BOS}[user] hello\n[assistant] ", False)
    for value in (str(tmp_path / "op.jinja"), OPERATOR):  # a file, or the template itself
        tok = load_tokenizer(path, value)
        assert tok.apply_chat_template(hello).tolist() == expected
        # vLLM puts the flag before the model's templates, the tool_use one too.
        assert tok.apply_chat_template(hello, [{"type": "function", "function": {"name": "f"}}]).tolist() == expected
    assert load_tokenizer(path).apply_chat_template(hello).tolist() != expected  # the model's own


def test_an_operators_chat_template_is_read_as_vllm_reads_the_flag(tmp_path: Path) -> None:
    from kvcompass.engine.chat_template import read_chat_template

    (tmp_path / "t.jinja").write_text("{{ messages }}")
    assert read_chat_template("t.jinja", tmp_path) == ("{{ messages }}", f"the chat template {tmp_path / 't.jinja'}")
    assert read_chat_template("{{ messages }}")[0] == "{{ messages }}"  # not a file, but Jinja
    assert read_chat_template("line one\nline two")[0] == "line one\nline two"
    with pytest.raises(InvalidArgumentError, match="looks like a file's path"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(InvalidArgumentError, match="looks like a file's path"):
        read_chat_template(str(tmp_path))  # a directory
    path = model_dir(tmp_path)
    with pytest.raises(InvalidArgumentError, match="not a valid Jinja template"):
        load_tokenizer(path, "{% for %}")
    with pytest.raises(InvalidArgumentError, match="needs the model's tokenizer"):
        load_tokenizer(None, OPERATOR)
    with pytest.raises(InvalidArgumentError, match="needs the model's tokenizer"):
        load_tokenizer(DEFAULT_TOKENIZER_PATH, OPERATOR)


def test_a_topologys_chat_template_reaches_the_door_and_the_emulated_workers(tmp_path: Path) -> None:
    """``chat_template`` in a topology is what ``kvcompass edge`` gives its door and ``kvcompass
    worker`` its emulated engine, so both render a chat alike; it needs the model's tokenizer."""
    from kvcompass.cli.services import _door_tokenizer
    from kvcompass.discovery.topology import TopologyError, load_topology
    from kvcompass.services.emulated_worker import EmulatedWorker, WorkerConfig

    path = model_dir(tmp_path)
    (tmp_path / "op.jinja").write_text(OPERATOR)
    body = 'rtt_ms = { a = { a = 1.0 } }\n[regions]\na = {}\n[[workers]]\nid = "a0"\nregion = "a"\n'
    (tmp_path / "t.toml").write_text(f'tokenizer = "{path.name}"\nchat_template = "op.jinja"\n' + body)
    topo = load_topology(str(tmp_path / "t.toml"))
    assert topo.chat_template == str((tmp_path / "op.jinja").resolve())
    hello = [{"role": "user", "content": "hello"}]
    expected = engine_ids(path, f"{BOS}[user] hello\n[assistant] ", False)
    assert _door_tokenizer(topo).apply_chat_template(hello).tolist() == expected
    worker = EmulatedWorker(WorkerConfig.from_spec(topo.workers[0], topo.block_size, tokenizer_path=topo.tokenizer, chat_template=topo.chat_template))
    assert worker.tokenizer.apply_chat_template(hello).tolist() == expected
    assert _door_tokenizer(load_topology("testbed-14x3")) is None  # no template: the door loads its own
    (tmp_path / "u.toml").write_text('chat_template = "op.jinja"\n' + body)
    with pytest.raises(TopologyError, match="needs the model's tokenizer"):
        load_topology(str(tmp_path / "u.toml"))
    (tmp_path / "v.toml").write_text(f'tokenizer = "{path.name}"\nchat_template = "missing.jinja"\n' + body)
    with pytest.raises(TopologyError, match="chat_template: no file"):
        load_topology(str(tmp_path / "v.toml"))
