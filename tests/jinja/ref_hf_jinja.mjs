// Reference renderer: @huggingface/jinja (the engine transformers.js uses), same cases and
// transformers' continue_final_message cut.   node ref_hf_jinja.mjs JINJA_MODULE_DIR CASES.json OUT.json
import fs from "fs";
import path from "path";
import { pathToFileURL } from "url";

const [modDir, casesPath, outPath] = process.argv.slice(2);
const { Template } = await import(pathToFileURL(path.join(modDir, "dist/index.js")).href);
const spec = JSON.parse(fs.readFileSync(casesPath, "utf8"));

function loadTemplate(dir) {
  let cfg = {};
  const p = path.join(dir, "tokenizer_config.json");
  if (fs.existsSync(p)) cfg = JSON.parse(fs.readFileSync(p, "utf8"));
  const special = {};
  for (const k of ["bos_token", "eos_token", "unk_token", "pad_token"]) {
    let v = cfg[k];
    if (v && typeof v === "object") v = v.content;
    if (v !== undefined && v !== null) special[k] = v;
  }
  const j = path.join(dir, "chat_template.jinja");
  if (fs.existsSync(j)) return [fs.readFileSync(j, "utf8"), special];
  let ct = cfg.chat_template;
  if (Array.isArray(ct)) ct = Object.fromEntries(ct.map((t) => [t.name, t.template])).default;
  return [ct, special];
}

const pyStrip = (s) => s.replace(/^\s+|\s+$/g, "");
const pyLstrip = (s) => s.replace(/^\s+/, "");

const templates = {};
for (const [name, dir] of Object.entries(spec.templates)) {
  const [src, special] = loadTemplate(dir);
  try {
    templates[name] = [new Template(src), special, null];
  } catch (e) {
    templates[name] = [null, special, String(e)];
  }
}
const out = [];
for (const c of spec.cases) {
  let [tmpl, special, err] = templates[c.template] || [null, {}, null];
  try {
    if (c.source !== undefined) [tmpl, special] = [new Template(c.source), {}];
    if (err) throw new Error(err);
    let text;
    if ((c.mode || "chat") === "raw") {
      text = tmpl.render({ ...special, ...c.context });
    } else {
      const chat = c.chat;
      const ctx = { ...special, ...(chat.chat_template_kwargs || {}), messages: chat.messages, tools: chat.tools ?? null,
                    documents: null, add_generation_prompt: chat.add_generation_prompt || false };
      text = tmpl.render(ctx);
      if (chat.continue_final_message) {
        let fin = chat.messages[chat.messages.length - 1].content;
        if (Array.isArray(fin)) fin = [...fin].reverse().find((b) => "text" in b).text;
        const loc = text.lastIndexOf(pyStrip(fin));
        if (loc < 0) throw new Error("final message not in the output");
        if (text.slice(loc, loc + pyLstrip(fin).length) === fin) text = text.slice(0, loc + pyLstrip(fin).length);
        else text = text.slice(0, loc + pyStrip(fin).length);
      }
    }
    out.push({ ok: true, text });
  } catch (e) {
    out.push({ ok: false, raise: false, error: String(e && e.message ? e.message : e) });
  }
}
fs.writeFileSync(outPath, JSON.stringify(out, null, 1));
