// Reference token ids and texts from @lenml/tokenizers (a port of transformers.js) for the
// real tokenizer.json files fetched by tests/fixtures/fetch_npm_fixtures.sh.
//   node tokenizer_reference.js FIXTURES_DIR OUT.json
// Writes {models: {name: {cases: [{text, ids, ids_plain, decoded, decoded_skip}],
//                         id_cases: [{ids, decoded, decoded_skip}]}}}.
// decoded: skip_special_tokens false; decoded_skip: true; both with clean_up_tokenization_spaces
// false (fdrollout never applies that English-specific clean-up, as vLLM's streaming does not).
"use strict";
const fs = require("fs");
const path = require("path");
const [fixtures, out] = process.argv.slice(2);
const { TokenizerLoader } = require(path.join(fixtures, "node_modules/@lenml/tokenizers"));

const { rng } = require(path.join(__dirname, "./prng.js"));

const fixed = [
  "Hello, world! This is a test.", "The quick brown fox jumps over the lazy dog.", "hello", " hello", "  hello  ",
  "I'm sure you've seen it; they'll say it's DON'T. She'd WE'RE 'S 'll",
  "你好，世界！今天天气很好。", "日本語のテキスト、カタカナ、ひらがな。", "한국어 문장입니다.", "Привет, мир! Ελληνικά. العربية. हिन्दी। ไทย",
  "👍🏽 family: 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 🙂🙃 ☕️",
  "caf\u00e9 na\u00efve \u00c5ngstr\u00f6m Ti\u1ebfng Vi\u1ec7t \uac00", "cafe\u0301 nai\u0308ve A\u030angstro\u0308m Tie\u0302\u0301ng Vie\u0323\u0302t \u1100\u1161",
  "e\u0301\u0301\u0301 a\u0328\u0301 \u0915\u094d\u0937 \u0e01\u0e33",
  "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
  "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
  "const x = {a: [1, 2, 3], 'b': \"c\"}; // comment\n/* block */ x?.a ?? null;",
  " ".repeat(100), "\n\n\n\n", "a" + " ".repeat(37) + "b", "\t\t\t x", "  \n  \n\t ", "end   ", "\r\n\r\n x \r\n",
  "1234567890", "3.14159 2024-12-01 1,000,000 007", "\u0663\u0664\u0665 \u2460\u2461\u2462 \u00bd \u2167",
  "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nx\n</think>\nok<|im_end|>",
  "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
  "<s>[INST] hi [/INST] ok </s><unk>", "text<|endoftext|>more <|im_end|>", "<|im_start|> <|im_end|>  <s>  </s>",
  "", "a", "\u2028line\u2029sep\u00a0nbsp\u3000ideographic\u2009thin",
];

function randomText(r) {
  const ranges = [[0x20, 0x7e], [0x20, 0x7e], [0x20, 0x7e], [0xa0, 0xff], [0x100, 0x17f], [0x370, 0x3ff],
                  [0x400, 0x4ff], [0x600, 0x6ff], [0x900, 0x97f], [0xe00, 0xe7f], [0x4e00, 0x9fff],
                  [0x3040, 0x30ff], [0xac00, 0xd7a3], [0x1f300, 0x1f64f], [0x300, 0x36f], [0x2000, 0x206f]];
  const n = 1 + Math.floor(r() * 40);
  let s = "";
  for (let i = 0; i < n; ++i) {
    if (r() < 0.15) { s += " \n\t"[Math.floor(r() * 3)]; continue; }
    const [a, b] = ranges[Math.floor(r() * ranges.length)];
    const cp = a + Math.floor(r() * (b - a + 1));
    if (cp === 0xfeff || cp === 0x85) continue;   // see docs: the regex \s of JS and PCRE2 differ here
    s += String.fromCodePoint(cp);
  }
  return s;
}

const r = rng(20261201);
const corpus = fixed.slice();
for (let i = 0; i < 300; ++i) corpus.push(randomText(r));
corpus.push(fixed.join(" ").repeat(8));   // one long input

const result = { models: {} };
for (const name of ["qwen3", "llama3", "llama3_1", "llama2"]) {
  const dir = path.join(fixtures, "models", name);
  const tok = TokenizerLoader.fromPreTrained({
    tokenizerJSON: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"))),
    tokenizerConfig: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"))),
  });
  const dec = (ids, skip) => ids.length === 0 ? "" :
    tok.decode(ids, { skip_special_tokens: skip, clean_up_tokenization_spaces: false });
  const cases = corpus.map((text) => {
    const ids = tok.encode(text);
    return { text, ids, ids_plain: tok.encode(text, { add_special_tokens: false }),
             decoded: dec(ids, false), decoded_skip: dec(ids, true) };
  });
  const vocab = tok.model.vocab.length;
  const ri = rng(7 + vocab);
  const id_cases = [];
  for (let i = 0; i < 100; ++i) {
    const ids = [];
    const n = 1 + Math.floor(ri() * 12);
    for (let k = 0; k < n; ++k) ids.push(Math.floor(ri() * vocab));
    if (tok.model.vocab.some((v, i) => v === undefined && ids.includes(i))) continue;
    id_cases.push({ ids, decoded: dec(ids, false), decoded_skip: dec(ids, true) });
  }
  result.models[name] = { cases, id_cases };
}
fs.writeFileSync(out, JSON.stringify(result));
