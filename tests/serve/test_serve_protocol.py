"""The OpenAI wire format and streaming detokenization, without Ray or a model."""
import json

import pytest

from pipeline.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, parse_body,
                                      specee_summary)
from pipeline.stream_text import IncrementalDecoder, StreamText
from tests.conftest import BUNDLED


@pytest.fixture(scope="module")
def tokenizer():
    from specee_core import load_tokenizer

    return load_tokenizer(BUNDLED)


def body(**kw) -> bytes:
    return json.dumps(kw).encode()


def test_parse_valid_completion():
    raw = body(model="m", prompt=["a", "b"], max_tokens=3, temperature=0, stop="x", seed=1)
    req = parse_body(raw, CompletionRequest)
    assert req.prompts == ["a", "b"]
    assert req.sampling(3) == {"max_new_tokens": 3, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "stop": ("x",),
                               "seed": 1, "max_disagreement": None, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                               "repetition_penalty": 1.0, "logit_bias": {}, "min_tokens": 0, "stop_token_ids": (),
                               "ignore_eos": False, "logprobs": None, "structured": None}
    defaults = parse_body(body(prompt="a", temperature=None), CompletionRequest).sampling(16)
    assert defaults["temperature"] == 1.0 and defaults["stop"] == ()  # OpenAI's defaults


@pytest.mark.parametrize("raw, param, code", [
    (b'{"prompt": ', None, "invalid_json"),
    (b"", None, "invalid_json"),
    (b'{"prompt": "\xff\xfe"}', None, "invalid_encoding"),
    (b'["a"]', None, "invalid_json"),
    (b'{"prompt": "a", "temperature": NaN}', None, "invalid_json"),
    (body(), "prompt", "missing_required_parameter"),
    (body(prompt=""), "prompt", "invalid_value"),
    (body(prompt=[]), "prompt", "invalid_value"),
    (body(prompt=["a", ""]), "prompt", "invalid_value"),
    (body(prompt=5), "prompt", "invalid_value"),
    (body(prompt=[1, 2]), "prompt", "invalid_value"),
    (b'{"prompt": "\\ud800"}', "prompt", "invalid_value"),
    (body(prompt="a", max_tokens=0), "max_tokens", None),
    (body(prompt="a", max_tokens="5"), "max_tokens", None),
    (body(prompt="a", max_tokens=1.5), "max_tokens", None),
    (body(prompt="a", max_tokens=True), "max_tokens", None),
    (body(prompt="a", temperature=-1), "temperature", None),
    (body(prompt="a", temperature="hot"), "temperature", None),
    (body(prompt="a", top_p=0), "top_p", None),
    (body(prompt="a", n=0), "n", None),
    (body(prompt="a", n=17), "n", None),
    (body(prompt="a", frequency_penalty=2.5), "frequency_penalty", None),
    (body(prompt="a", logit_bias={"x": 1}), "logit_bias", None),
    (body(prompt="a", logit_bias={"5": 101}), "logit_bias", None),
    (body(prompt="a", stream="yes"), "stream", None),
    (body(prompt="a", stop=[""]), "stop", "invalid_value"),
    (body(prompt="a", stop=5), "stop", None),
    (body(prompt="a", stop=list("abcde")), "stop", "invalid_value"),
    (body(prompt="a", echo=True), "echo", "invalid_value"),
    (body(prompt="a", logprobs=21), "logprobs", None),
    (body(prompt="a", mode="fast"), "mode", None),
    (body(prompt="a", max_disagreement=1.5), "max_disagreement", None),
    (body(prompt="a", max_disagreement=0), "max_disagreement", None),
    (body(prompt="a", seed=2**70), "seed", None),
])
def test_parse_rejects(raw, param, code):
    with pytest.raises(APIError) as e:
        parse_body(raw, CompletionRequest)
    err = e.value.body()["error"]
    assert e.value.status == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]
    if code:
        assert err["code"] == code


def test_chat_asks_for_logprobs_n_and_penalties_and_refuses_what_it_cannot_do():
    req = parse_body(body(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3, n=2,
                          frequency_penalty=1.5, logit_bias={"7": -100}, response_format={"type": "text"}),
                     ChatCompletionRequest)
    p = req.sampling(8)
    assert p["logprobs"] == 3 and p["frequency_penalty"] == 1.5 and p["logit_bias"] == {7: -100.0} and req.n == 2
    assert parse_body(body(messages=[{"role": "user", "content": "hi"}], logprobs=True),
                      ChatCompletionRequest).sampling(8)["logprobs"] == 0
    assert parse_body(body(prompt="a", logprobs=2), CompletionRequest).sampling(8)["logprobs"] == 2
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = parse_body(body(messages=[{"role": "user", "content": "hi"}], response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}), ChatCompletionRequest)
    assert fmt.sampling(8)["structured"] == {"type": "json_schema", "schema": schema}
    assert parse_body(body(prompt="a", guided_choice=["yes", "no"]), CompletionRequest).sampling(8)["structured"] == {
        "type": "choice", "choices": ["yes", "no"]}
    for bad, param in [(dict(top_logprobs=2), None), (dict(tools=[{"type": "function"}]), "tools"),
                       (dict(response_format={"type": "json_schema"}), "response_format"),
                       (dict(response_format={"type": "xml"}), "response_format.type"),
                       (dict(response_format={"type": "json_object"}, guided_regex="a+"), None)]:
        with pytest.raises(APIError) as e:
            parse_body(body(messages=[{"role": "user", "content": "hi"}], **bad), ChatCompletionRequest)
        assert e.value.status == 400 and e.value.param == param, e.value.message


def test_parse_chat():
    req = parse_body(body(messages=[{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                          max_completion_tokens=5), ChatCompletionRequest)
    assert req.max_tokens == 5
    assert req.template_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for bad, param in [(body(messages=[]), "messages"), (body(messages=[{"role": "robot", "content": "x"}]),
                                                          "messages.0.role"),
                       (body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
                        "messages.0.content.0.type")]:
        with pytest.raises(APIError) as e:
            parse_body(bad, ChatCompletionRequest)
        assert e.value.param == param, e.value.message


def test_incremental_decoder_multibyte(tokenizer):
    text = "héllo 日本語 🙂 done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    dec = IncrementalDecoder(tokenizer)
    deltas = [dec.push(t) for t in ids]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert len(ids) > len(text.split())  # the emoji and CJK characters do span several tokens


@pytest.mark.parametrize("stop", [("日本",), ("lo 日",), ("zzz", "🙂 d")])
def test_stream_text_never_sends_stop(tokenizer, stop):
    text = "héllo 日本語 🙂 done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    st = StreamText(tokenizer, stop)
    sent = "".join(st.push(t) for t in ids)
    cut = min(i for i in (text.find(s) for s in stop) if i >= 0)
    assert sent == text[:cut] and st.stopped
    assert st.finish(text[:cut]) == ""


def test_stream_text_finish_flushes_holdback(tokenizer):
    ids = tokenizer("abc def", add_special_tokens=False)["input_ids"]
    st = StreamText(tokenizer, ("xyz",))
    sent = "".join(st.push(t) for t in ids)
    assert sent + st.finish("abc def") == "abc def"


def test_specee_summary():
    class R:
        def __init__(self, hist):
            self.stats = {"exit_histogram": hist}

    s = specee_summary([R([1, 0, 3]), R([0, 0, 2])], num_layers=3, mode="specee", batch_size=2)
    assert s["exit_histogram"] == [1, 0, 5] and s["avg_layers"] == pytest.approx(16 / 6)
    assert s["layer_fraction"] == pytest.approx(16 / 18) and s["batch_size"] == 2


# ---- access: closed unless opened -------------------------------------------------------------------
@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.0.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LocalHost", True), ("0.0.0.0", False), ("::", False), ("192.168.1.20", False), ("10.0.0.1", False),
    ("myhost.example.com", False),  # a name may resolve to any interface
])
def test_is_loopback(host, loopback):
    from pipeline.serve_access import is_loopback

    assert is_loopback(host) is loopback


def test_check_exposure_refuses_an_open_host_without_keys(caplog):
    from pipeline.serve_access import check_exposure, log

    with pytest.raises(ValueError) as e:
        check_exposure("0.0.0.0", has_keys=False, allow_open=False)
    assert str(e.value) == ("Serve listens on 0.0.0.0 and no api_keys are set: set api_keys / SPECEE_API_KEYS / "
                            "api_keys_file / SPECEE_API_KEYS_FILE, or pass allow_open=True to serve without keys")
    with pytest.raises(ValueError, match="Serve listens on :: and"):
        check_exposure("::", has_keys=False, allow_open=False)
    log.addHandler(caplog.handler)  # Ray's logging config may stop "ray.*" loggers reaching the root logger
    try:
        for host in ("127.0.0.1", "localhost", "::1", None):  # loopback, or HTTP off: no keys needed
            check_exposure(host, has_keys=False, allow_open=False)
        check_exposure("0.0.0.0", has_keys=True, allow_open=False)
        assert not caplog.records
        check_exposure("0.0.0.0", has_keys=False, allow_open=True)  # opened on purpose: deploys, loudly
    finally:
        log.removeHandler(caplog.handler)
    assert {r.levelname for r in caplog.records} == {"WARNING"}  # once per handler it reaches
    assert "SERVING WITHOUT API KEYS on 0.0.0.0 (allow_open=True)" in caplog.text


def test_read_keys_file(tmp_path):
    from pipeline.serve_access import read_keys_file

    f = tmp_path / "keys.txt"
    f.write_text("# production\nkey-one\n\n   key-two  \n  # rotated 2024-05\nkey#three\n")
    assert read_keys_file(f) == ["key-one", "key-two", "key#three"]  # only whole-line comments


@pytest.mark.parametrize("content, message", [
    (None, "cannot be read: No such file or directory"),
    ("", "holds no key"),
    ("\n  \n# only a comment\n", "holds no key"),
    (b"\xff\xfe key", "is not UTF-8 text"),
    ("dir", "cannot be read: Is a directory"),
])
def test_read_keys_file_errors_name_the_file(tmp_path, content, message):
    from pipeline.serve_access import read_keys_file

    f = tmp_path / "keys.txt"
    if content == "dir":
        f.mkdir()
    elif isinstance(content, bytes):
        f.write_bytes(content)
    elif content is not None:
        f.write_text(content)
    with pytest.raises(ValueError) as e:
        read_keys_file(f)
    assert str(e.value).startswith(f"api_keys_file '{f}' ") and message in str(e.value), str(e.value)


def test_bearer_ok():
    from pipeline.serve_access import bearer_ok

    keys = [b"key-one", b"key-two"]
    assert bearer_ok("Bearer key-two", keys) and bearer_ok("bearer  key-one ", keys)
    assert not any(bearer_ok(h, keys) for h in ("", "Bearer", "Bearer key-on", "Basic key-one", "key-one"))
