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

from kvcompass.engine.chat_template import ChatTemplate, load_chat_template
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
    assert load_tokenizer(model_dir(tmp_path / "a", template=None)).chat_template is None
    named = model_dir(tmp_path / "b", template=[{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}])
    assert load_tokenizer(named).chat_template is not None
    bad = tmp_path / "c"
    (bad / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="cannot be read as JSON"):
        load_chat_template(bad / "tokenizer_config.json")


def test_the_built_in_tokenizer_is_its_own_engines_and_unchanged() -> None:
    tok = load_tokenizer(None)
    text = "plain text <|im_start|> with a special token spelled"
    assert tok.chat_template is None
    assert np.array_equal(tok.encode_prompt(text), tok.encode(text))
