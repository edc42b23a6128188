"""Untrusted text (issue 48, items 3, 4 and 7): a chat template, a completion or a gold answer built to
cost without bound is handled in linear time; a tokenizer.json is checked as the project uses it (its ids,
ChatML tokens, truncation and padding, post-processor, normalizer, a model that cannot encode); bytes of a
--data file that are not UTF-8 are named. Error cases go through test_bad_inputs' Case harness (one
stderr line, files around unchanged); notes and timings are plain tests."""
import json
import os
import shutil
import time

import pytest

import test_bad_inputs as bad
from test_bad_inputs import Case

hf_files, tasks = bad.hf_files, bad.tasks
M = ["--model", "{model}"]
# a template the old lazy regex took minutes over: every <|im_start|>system\n scanned on to a late quote
SLOW_TEMPLATE = ("<|im_start|>system\n" + "a" * 50) * 30_000 + "'<|im_end|>"  # 2.1 MB


def _tokenizer(change):  # setup: the model copy's tokenizer.json changed by change(dict)
    return lambda tmp: bad.edit_json(f"{tmp}/model/tokenizer.json", lambda d: change(d) or d)


def _rename_added(old, new):
    def change(d):
        next(t for t in d["added_tokens"] if t["content"] == old)["content"] = new
    return change


def _word_level(d):  # the same ids, as a WordLevel model whose [UNK] is not in its vocabulary
    d["model"] = {"type": "WordLevel", "vocab": d["model"]["vocab"], "unk_token": "[UNK]"}
    d["pre_tokenizer"] = {"type": "Whitespace"}


def _adds(token, token_id, before=False):  # a post-processor writing `token` after (or before) every text
    text, special = {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": token, "type_id": 0}}
    return lambda d: d.update(post_processor={
        "type": "TemplateProcessing", "single": [special, text] if before else [text, special],
        "pair": [text, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {token: {"id": token, "ids": [token_id], "tokens": [token]}}})


def _jinja_template(text):  # newer transformers save the template as chat_template.jinja
    def setup(tmp):
        bad.edit_json(f"{tmp}/model/tokenizer_config.json", lambda d: dict(d, chat_template=None))
        bad.write(f"{tmp}/model/chat_template.jinja", text)
    return setup


LLAMA3_TEMPLATE = ("{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + "
                   "m['content'] + '<|eot_id|>' }}{% endfor %}")
CASES = [
    Case("03-tokenizer-duplicate-ids", "qerl/rollout", M, "tokenizer.json gives id 64 to two tokens, 'a' and 'b'",
         setup=_tokenizer(lambda d: d["model"]["vocab"].update(b=d["model"]["vocab"]["a"]))),
    Case("03-tokenizer-added-id-taken", "qerl/rollout", M, "tokenizer.json lists '<|im_start|>' as id 7",
         setup=_tokenizer(lambda d: d["added_tokens"][1].update(id=7))),
    Case("03-tokenizer-word-level-without-unk", "qerl/rollout", M, "tokenizer.json cannot encode a prompt (WordLevel "
         "error: Missing [UNK] token", setup=_tokenizer(_word_level)),
    Case("03-tokenizer-appends-eos", "qerl/rollout", M, "tokenizer.json: its post-processor adds ['<|endoftext|>'] to "
         "every prompt", setup=_tokenizer(_adds("<|endoftext|>", 281))),
    Case("03-tokenizer-without-chatml", "qerl/rollout", M, "tokenizer.json has no <|im_start|> token",
         setup=_tokenizer(_rename_added("<|im_start|>", "<|startoftext|>"))),
    Case("03-template-not-chatml", "qerl/rollout", M, "tokenizer_config.json: the chat template is not ChatML",
         setup=lambda t: bad.edit_json(f"{t}/model/tokenizer_config.json",
                                       lambda d: dict(d, chat_template=LLAMA3_TEMPLATE))),
    Case("03-template-jinja-not-chatml", "qerl/rollout", M, "chat_template.jinja: the chat template is not ChatML",
         setup=_jinja_template(LLAMA3_TEMPLATE)),
    Case("05-gold-huge-exponent", "qerl/train", bad.GSM8K, "d.jsonl:3: the answer after '####' is '1e100000000', over "
         "100 characters written out", setup=bad._gsm8k_with("1e100000000")),
    Case("05-gold-5000-digits", "qerl/train", bad.GSM8K, "d.jsonl:3: the answer after '####' is '11111111111111111111'"
         "..., over 100 characters", setup=bad._gsm8k_with("1" * 5000)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_text(case, tmp_path, capsys):
    bad.run_case(case, str(tmp_path), capsys)


# -----------------------------------------------------------------------------
# Tokenizer settings the project turns off or names (a note, once)

def _model(tmp_path, change=None, template=None):
    folder = tmp_path / "model"
    shutil.copytree(bad.TINY, folder)
    if change:
        _tokenizer(change)(str(tmp_path))
    if template is not None:
        bad.edit_json(folder / "tokenizer_config.json", lambda d: dict(d, chat_template=template))
    return folder


PROMPT = hf_files.chat_prompt("12+345-6=?")
WHOLE = hf_files.load_tokenizer(bad.TINY).encode(PROMPT)  # the bundled tokenizer, unchanged


def test_bundled_and_byte_tokenizers_load_without_a_note(tmp_path, capsys):
    assert len(WHOLE) == 18
    assert hf_files.byte_tokenizer().decode(hf_files.byte_tokenizer().encode("12 héllo")) == "12 héllo"
    # SmolLM2's post-processor (assets/smollm2.py) is ByteLevel offsets only: it adds no token, no note
    folder = _model(tmp_path, lambda d: d.update(post_processor={"type": "ByteLevel", "add_prefix_space": False,
                                                                 "trim_offsets": False, "use_regex": True}))
    capsys.readouterr()
    assert hf_files.load_tokenizer(folder).encode(PROMPT) == WHOLE
    assert capsys.readouterr().out == ""


def test_truncation_padding_and_dropout_are_turned_off_with_one_note(tmp_path, capsys):
    folder = _model(tmp_path, lambda d: d.update(
        truncation={"max_length": 8, "strategy": "LongestFirst", "stride": 0, "direction": "Right"},
        padding={"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 281,
                 "pad_type_id": 0, "pad_token": "<|endoftext|>"}) or d["model"].update(dropout=0.5))
    capsys.readouterr()
    tok = hf_files.load_tokenizer(folder)
    assert [tok.encode(PROMPT) for _ in range(5)] == [WHOLE] * 5  # not cut to 8, nor padded, nor split at random
    hf_files.load_tokenizer(folder)  # as 05 loads it, twice: said once
    assert capsys.readouterr().out.splitlines() == [
        f"note | {folder / 'tokenizer.json'}: turned off its truncation, padding, dropout: prompts are encoded "
        "whole, the same every time"]


def test_a_bos_post_processor_and_a_changing_normalizer_are_named(tmp_path, capsys):
    folder = _model(tmp_path, _adds("<|endoftext|>", 281, before=True))
    capsys.readouterr()
    assert hf_files.load_tokenizer(folder).encode(PROMPT) == [281, *WHOLE]  # kept: Llama 3 adds its BOS so
    assert "its post-processor starts every prompt with '<|endoftext|>'" in capsys.readouterr().out
    # a normalizer that drops digits: the arithmetic questions lose their numbers
    shutil.rmtree(folder)
    folder = _model(tmp_path, lambda d: d.update(normalizer={"type": "Replace", "pattern": {"Regex": "[0-9]"},
                                                             "content": ""}))
    hf_files.load_tokenizer(folder)
    out = capsys.readouterr().out
    assert "its normalizer or pre-tokenizer changes the text of prompts ('ser\\nWhat is 12 + 3.5?<|i' reads " \
           "back as 'ser\\nWhat is  + .?<|im_en')" in out


# -----------------------------------------------------------------------------
# Bounded work: a 2 MB template, completions and gold answers built to be slow

def test_a_2_mb_chat_template_is_read_in_well_under_a_second(tmp_path):
    folder = _model(tmp_path, template=SLOW_TEMPLATE)
    start = time.perf_counter()
    assert hf_files.load_tokenizer(folder).default_system is None  # a quote before its <|im_end|>: no message
    assert hf_files.default_system("<|im_start|>system" * 100_000 + "<|im_end|>" * 100_000) is None
    assert time.perf_counter() - start < 1.0  # the regex this replaced: minutes
    # still found where it is: the message before the first <|im_end|> with no quote on the way
    assert hf_files.default_system(SLOW_TEMPLATE + "<|im_start|>system\\nHi.<|im_end|>") == "Hi."


def test_pathological_completions_are_scored_in_well_under_a_second():
    n = 250_000  # characters: far past any --max-new-tokens (the scorer's time grows linearly with them)
    texts = ["<answer>" * (n // 8),                                 # a lazy regex rescanned from each one
             "<think>" + "a" * n + "</think><answer>7</answer>x",   # the format's tempered dots, failing
             "<think>a</think><answer>" + "1" * n + "</answer>",    # a number of n digits
             "<think>a</think><answer>1." + "0," * (n // 2) + "</answer>",
             "-." * n]
    start = time.perf_counter()
    rewards = [tasks.reward_fn(t, "7") for t in texts]
    assert time.perf_counter() - start < 1.0
    assert rewards == [0.0, 1.0, 0.0, 0.0, 0.0]  # a number too long to read is no answer: not correct
    assert tasks.answer_block("<answer>1</answer> <answer><answer>2</answer><answer>3") == "<answer>2"


def test_gold_numbers_are_bounded(tmp_path):
    big = "9" * 99 + "0"  # 100 characters: the longest number scored
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {g}"}) + "\n"
                            for i, g in enumerate(["1e99", big, "-2.5e3"])))
    rows = tasks.load_jsonl(str(path))
    assert [r["answer"] for r in rows] == ["1" + "0" * 99, big, "-2500"]
    assert tasks.answer_correct(f"<answer>{big}</answer>", rows[1]["answer"])
    assert not tasks.answer_correct(f"<answer>{big}0</answer>", big + "0")  # 101: never correct, even if equal
    for i, gold in enumerate(["1e100000000", "9" * 5000, "-1.5e99", "1e-100000000"]):
        path.write_text(f'{{"question": "q", "answer": "#### 1"}}\n{{"question": "q", "answer": "#### 2"}}\n'
                        f'{{"question": "q", "answer": "#### {gold}"}}\n')
        start = time.perf_counter()
        with pytest.raises(ValueError, match=r"train.jsonl:3: the answer after '####' is .* over 100 characters "
                                             r"written out"):
            tasks.load_jsonl(str(path))
        assert time.perf_counter() - start < 1.0


# -----------------------------------------------------------------------------
# --data bytes that are not UTF-8

def test_lines_that_are_not_utf8_are_skipped_and_named(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    rows = [json.dumps({"question": f"q{i} caf\u00e9", "answer": f"#### {i}"}).encode() for i in range(4)]
    rows[1] = rows[1].replace(b"caf\\u00e9", b"caf\xe9")  # Latin-1, as an old export writes it
    rows[3] = rows[3].replace(b"caf\\u00e9", b"caf\xff\xfe")
    path.write_bytes(b"\n".join(rows) + b"\n")
    kept = tasks.load_jsonl(str(path))
    assert [p["question"] for p in kept] == ["q0 caf\u00e9", "q2 caf\u00e9"]
    assert capsys.readouterr().out == f"data | {path}:2: bytes that are not UTF-8 (U+FFFD): skipped 2 such line(s)\n"
    path.write_bytes(rows[1])
    with pytest.raises(ValueError, match="has no usable problems"):
        tasks.load_jsonl(str(path))
    assert os.path.exists(path)
