// Continue's own published code against a live tabloop front door (tests/test_continue_contract.py runs
// this; no network but the front door on the loopback). One mode per run, its input a JSON file, its
// findings one JSON object on stdout: the Python test asserts on them.
//
//   node contract.mjs client   in.json  openai-adapters (completion stream, non-stream, FIM stream, abort,
//                                       wrong key) and @continuedev/fetch's streamSse on raw responses
//   node contract.mjs config   in.json  config-yaml's parser and validator on config files
//   node contract.mjs devdata  in.json  data: payloads built with config-yaml's dev-data schemas, POSTed as
//                                       Continue's DataLogger does
import { readFileSync } from "node:fs";
import { constructLlmApi } from "@continuedev/openai-adapters";
import { streamSse } from "@continuedev/fetch";
import { devDataVersionedSchemas, parseConfigYaml, validateConfigYaml } from "@continuedev/config-yaml";

const [mode, inputFile] = process.argv.slice(2);
const input = JSON.parse(readFileSync(inputFile, "utf8"));

async function collect(gen, pick) {
  const chunks = [];
  for await (const chunk of gen) chunks.push(chunk);
  return { text: chunks.map(pick).join(""), chunks };
}

async function settle(promise) {
  try {
    return { ok: true, value: await promise };
  } catch (e) {
    return { ok: false, error: String(e?.message ?? e), status: e?.status ?? null, name: e?.name ?? null };
  }
}

async function client({ base, key, badKey, prompt, suffix }) {
  const api = constructLlmApi({ provider: "openai", apiBase: base, apiKey: key });
  const body = { model: "qwen2.5-coder-1.5b", prompt, max_tokens: 12 };
  const out = {};
  // The legacy completions API, as Continue's autocomplete uses it with provider: openai.
  const stream = await collect(api.completionStream({ ...body, stream: true }, new AbortController().signal),
                               (c) => c.choices[0]?.text ?? "");
  out.stream = { text: stream.text, ids: [...new Set(stream.chunks.map((c) => c.id))],
                 finish: stream.chunks.at(-1)?.choices[0]?.finish_reason ?? null };
  const whole = await api.completionNonStream({ ...body, stream: false }, new AbortController().signal);
  out.nonStream = { id: whole.id, text: whole.choices[0].text, usage: whole.usage ?? null };
  // fimStream: POST {apiBase}fim/completions, what Continue's FIM providers use; it reads delta.content.
  const fim = await settle(collect(api.fimStream({ ...body, suffix }, new AbortController().signal),
                                   (c) => c.choices[0]?.delta?.content ?? ""));
  out.fim = fim.ok ? { text: fim.value.text, ids: [...new Set(fim.value.chunks.map((c) => c.id))],
                       objects: [...new Set(fim.value.chunks.map((c) => c.object))] } : fim;
  // Abort after the first chunk, as Continue does when the user types on (a long completion: the seed
  // test_serving's disconnect test uses, so it is still generating when the abort comes).
  const controller = new AbortController();
  let abortedId = null;
  const aborted = await settle((async () => {
    for await (const chunk of api.completionStream(
      { ...body, prompt: "import sys\n", max_tokens: 256, temperature: 1.0, seed: 5, stop: [], stream: true },
      controller.signal)) {
      abortedId = chunk.id;
      controller.abort();
    }
  })());
  out.abort = { id: abortedId, error: aborted.ok ? null : aborted.name || aborted.error };
  const wrong = constructLlmApi({ provider: "openai", apiBase: base, apiKey: badKey });
  const refused = await settle(wrong.completionNonStream({ ...body, stream: false }, new AbortController().signal));
  out.wrongKey = { ok: refused.ok, status: refused.status, error: refused.error ?? null };
  // streamSse on raw responses: the parser every Continue provider reads server-sent events with.
  const headers = { "Content-Type": "application/json", Authorization: `Bearer ${key}` };
  for (const [name, path, extra] of [["sseCompletions", "completions", {}], ["sseFim", "fim/completions", { suffix }]]) {
    const resp = await fetch(new URL(path, base), { method: "POST", headers,
      body: JSON.stringify({ ...body, ...extra, stream: true, stream_options: { include_usage: true } }) });
    const chunks = [];
    for await (const chunk of streamSse(resp)) chunks.push(chunk);
    out[name] = { status: resp.status, n: chunks.length, usage: chunks.find((c) => c.usage)?.usage ?? null,
                  text: chunks.map((c) => c.choices?.[0]?.text ?? "").join(""),
                  completionId: resp.headers.get("x-tabloop-completion-id") };
  }
  return out;
}

function config({ files }) {
  const out = {};
  for (const file of files) {
    try {
      const parsed = parseConfigYaml(readFileSync(file, "utf8"));
      out[file] = { parsed: true, errors: validateConfigYaml(parsed).map((e) => e.message),
                    models: (parsed.models ?? []).map((m) => m.name ?? m.uses ?? null),
                    data: (parsed.data ?? []).map((d) => d.name ?? d.uses ?? null) };
    } catch (e) {
      out[file] = { parsed: false, errors: [String(e.message)] };
    }
  }
  return out;
}

// Continue's autocomplete defaults (core/util/parameters.ts) and the base fields its DataLogger adds.
const AUTOCOMPLETE_OPTIONS = { disable: false, maxPromptTokens: 1024, debounceDelay: 350, maxSuffixPercentage: 0.2,
  prefixPercentage: 0.3, multilineCompletions: "auto", slidingWindowPrefixPercentage: 0.75, slidingWindowSize: 500,
  useCache: true, onlyMyCode: true, useRecentlyEdited: true, useImports: true, transform: true };

async function devdata({ destination, apiKey, events }) {
  const out = [];
  for (const { name, level, schema = "0.2.0", fields } of events) {
    const eventSchema = devDataVersionedSchemas[schema][level][name];
    const base = { eventName: name, schema, timestamp: new Date().toISOString(), userId: "contract-user",
                   userAgent: "Visual Studio Code/1.99.0 (Continue/1.2.0)", selectedProfileId: "local" };
    const raw = name === "autocomplete" ? { ...AUTOCOMPLETE_OPTIONS, ...base, ...fields } : { ...base, ...fields };
    const parsed = eventSchema.safeParse(raw);  // zod drops what the level leaves out (noCode: the code)
    if (!parsed.success) {
      out.push({ name, level, built: false, error: parsed.error.message });
      continue;
    }
    const resp = await fetch(destination, { method: "POST",
      headers: { "Content-Type": "application/json", Authorization: `Bearer ${apiKey}` },
      body: JSON.stringify({ name, data: parsed.data, schema, level, profileId: "local" }) });
    out.push({ name, level, built: true, status: resp.status, body: await resp.json(),
               sentKeys: Object.keys(parsed.data).sort() });
  }
  return out;
}

const modes = { client, config, devdata };
if (!modes[mode]) {
  console.error(`unknown mode ${mode}: one of ${Object.keys(modes).join(", ")}`);
  process.exit(2);
}
process.stdout.write(JSON.stringify(await modes[mode](input)) + "\n");
