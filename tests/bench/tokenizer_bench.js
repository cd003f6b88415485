// Tokenizer throughput of @lenml/tokenizers (transformers.js port), the reference side of
// tests/bench/run_tokenizer_bench.sh.
//   node tokenizer_bench.js corpus FIXTURES_DIR OUT_CORPUS.json     write the mixed corpus
//   node tokenizer_bench.js time FIXTURES_DIR CORPUS.json MODELS SECONDS_MIN
// `time` prints one JSON object: per model {encode_mb_s, decode_tokens_s, bytes, tokens}.
// Encode: every document encoded (add_special_tokens false), repeated until SECONDS_MIN has
// passed; decode: every document's ids decoded (skip_special_tokens false, no clean-up).
"use strict";
const fs = require("fs");
const path = require("path");
const [mode, fixtures, file, models, secondsMin] = process.argv.slice(2);

const { rng } = require(path.join(__dirname, "../reference/prng.js"));

function makeCorpus() {
  const r = rng(42);
  const pick = (a) => a[Math.floor(r() * a.length)];
  const words = ("the of and to in is was that for on with as by at from it his her they we you this be are " +
    "model training reward policy gradient token sequence value function sample batch learning rate " +
    "Lily Tom park ball happy little played ran jumped Once upon time there named said because").split(" ");
  const prose = () => {
    let s = "";
    for (let i = 0; i < 12; ++i) {
      let w = pick(words);
      if (i === 0) w = w[0].toUpperCase() + w.slice(1);
      s += (i ? " " : "") + w;
      if (r() < 0.08) s += ",";
      if (r() < 0.05) s += " " + Math.floor(r() * 100000);
      if (r() < 0.03) s += " don't";
    }
    return s + pick([".", "!", "?", "...", ".\n"]);
  };
  const code = () => {
    const n = pick(["x", "value", "items", "total", "idx"]);
    return `def f_${Math.floor(r() * 1000)}(${n}):\n    if ${n} is None:\n        return []\n` +
      `    for i in range(len(${n})):\n        ${n}[i] += ${Math.floor(r() * 10)}  # update\n    return ${n}\n\n` +
      `int g(const int *p, size_t n) {\n\tint s = 0;\n\tfor (size_t i = 0; i < n; ++i) { s += p[i]; }\n\treturn s;\n}\n`;
  };
  const cjk = () => {
    let s = "";
    for (let i = 0; i < 60; ++i) s += r() < 0.1 ? pick(["，", "。", "、", "！"]) : String.fromCodePoint(0x4e00 + Math.floor(r() * 0x2000));
    return s + "\n";
  };
  const mixed = () => {
    let s = "";
    for (let i = 0; i < 30; ++i) {
      const k = r();
      s += k < 0.2 ? String.fromCodePoint(0x1f600 + Math.floor(r() * 0x40)) : k < 0.4 ? "caf\u00e9 na\u00efve " :
           k < 0.5 ? "Привет мир " : k < 0.6 ? "    " : k < 0.7 ? "\n\n" : k < 0.8 ? "12345 " : pick(words) + " ";
    }
    return s;
  };
  const docs = [];
  let bytes = 0;
  while (bytes < 1 << 20) {
    const k = r();
    let d = "";
    const parts = 4 + Math.floor(r() * 8);
    for (let i = 0; i < parts; ++i) d += (k < 0.5 ? prose : k < 0.7 ? code : k < 0.85 ? cjk : mixed)() + " ";
    docs.push(d);
    bytes += Buffer.byteLength(d);
  }
  return docs;
}

if (mode === "corpus") {
  fs.writeFileSync(file, JSON.stringify(makeCorpus()));
} else {
  const { TokenizerLoader } = require(path.join(fixtures, "node_modules/@lenml/tokenizers"));
  const docs = JSON.parse(fs.readFileSync(file));
  const bytes = docs.reduce((a, d) => a + Buffer.byteLength(d), 0);
  const out = {};
  for (const name of models.split(",")) {
    const dir = path.join(fixtures, "models", name);
    const tok = TokenizerLoader.fromPreTrained({
      tokenizerJSON: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"))),
      tokenizerConfig: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"))),
    });
    let ids = docs.map((d) => tok.encode(d, { add_special_tokens: false }));   // warm-up (also fills its cache)
    const tokens = ids.reduce((a, v) => a + v.length, 0);
    let t0 = process.hrtime.bigint(), reps = 0, dt = 0;
    do {
      ids = docs.map((d) => tok.encode(d, { add_special_tokens: false }));
      ++reps;
      dt = Number(process.hrtime.bigint() - t0) / 1e9;
    } while (dt < +secondsMin);
    const encode_mb_s = (bytes * reps) / dt / 1e6;
    t0 = process.hrtime.bigint(); reps = 0;
    do {
      for (const v of ids) tok.decode(v, { skip_special_tokens: false, clean_up_tokenization_spaces: false });
      ++reps;
      dt = Number(process.hrtime.bigint() - t0) / 1e9;
    } while (dt < +secondsMin);
    out[name] = { encode_mb_s, decode_tokens_s: (tokens * reps) / dt, bytes, tokens };
  }
  console.log(JSON.stringify(out));
}
