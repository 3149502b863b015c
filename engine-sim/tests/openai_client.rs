//! The official OpenAI Python client against the engine: if it accepts our responses, a router
//! cannot tell the engine from a real OpenAI-compatible server. Skipped through
//! `test_support::skip` (so the run's summary names it) when python3 or the `openai` package is
//! missing, and failed for it under `CI=true` (CI installs it).

mod common;

use std::process::Command;

use common::{fast_config, TestServer};

const SCRIPT: &str = r#"
import sys
import openai

client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0, timeout=20)
system = "You are a helpful assistant for the prefix-router project. " * 40
msgs = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]

r = client.chat.completions.create(model="any-model", messages=msgs, max_tokens=5)
assert r.object == "chat.completion", r
assert r.model == "any-model", r
assert r.choices[0].message.role == "assistant", r
assert r.choices[0].finish_reason == "length", r
assert len(r.choices[0].message.content.split(" ")) == 5, r
assert r.usage.completion_tokens == 5, r.usage
assert r.usage.prompt_tokens_details.cached_tokens == 0, r.usage

again = client.chat.completions.create(model="any-model", messages=msgs, max_tokens=5)
assert again.usage.prompt_tokens_details.cached_tokens > 0, again.usage
assert again.choices[0].message.content == r.choices[0].message.content

stream = client.chat.completions.create(
    model="any-model", messages=msgs, max_tokens=4, stream=True,
    stream_options={"include_usage": True},
)
content, usage, finish = "", None, None
for chunk in stream:
    assert chunk.object == "chat.completion.chunk", chunk
    if chunk.choices:
        content += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    if chunk.usage:
        usage = chunk.usage
assert len(content.split(" ")) == 4, content
assert finish == "length", finish
assert usage.completion_tokens == 4 and usage.prompt_tokens_details.cached_tokens > 0, usage

c = client.completions.create(model="m", prompt="Once upon a time", max_tokens=3)
assert c.object == "text_completion", c
assert len(c.choices[0].text.split(" ")) == 3, c
assert c.usage.prompt_tokens == 4, c.usage

text = "".join(ch.choices[0].text for ch in
               client.completions.create(model="m", prompt="Once upon a time", max_tokens=3, stream=True)
               if ch.choices)
assert text == c.choices[0].text, (text, c.choices[0].text)

assert [m.id for m in client.models.list().data] == ["llama-3.1-70b"]

try:
    client.chat.completions.create(model="m", messages="not a list")
except openai.BadRequestError as e:
    assert e.status_code == 400
    assert "messages" in str(e), str(e)
else:
    raise AssertionError("expected a 400")
print("openai client ok")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_python_client_accepts_the_engine() {
    let test = "the_official_openai_python_client_accepts_the_engine";
    let openai =
        test_support::python_modules(&["openai"]).map_err(|e| format!("{e} (pip install openai)"));
    if test_support::require_tool(test, openai).is_none() {
        return;
    }
    let server = TestServer::start(fast_config()).await;
    let base = format!("http://{}", server.addr);
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3").args(["-c", SCRIPT, &base]).output()
    })
    .await
    .unwrap()
    .unwrap();
    assert!(
        out.status.success(),
        "python client failed:\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "openai client ok"
    );
    server.stop().await;
}
