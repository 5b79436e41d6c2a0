// Rebuilds ../static/agui-client.js (one minified ES module) and its licence file from node_modules.
// Run: npm ci && npm run build (the result is committed: installing trio_agent needs no Node).
import { build } from "esbuild";
import { readFileSync, readdirSync, writeFileSync, existsSync } from "node:fs";
import { join } from "node:path";

const out = new URL("../static/", import.meta.url).pathname;
const result = await build({
  entryPoints: ["entry.mjs"],
  bundle: true,
  format: "esm",
  minify: true,
  platform: "browser",
  target: "es2020",
  metafile: true,
  legalComments: "none",
  outfile: join(out, "agui-client.js"),
});

// Every package that contributed code, with its licence text.
const packages = new Set();
for (const input of Object.keys(result.metafile.inputs)) {
  const match = input.match(/node_modules\/((?:@[^/]+\/)?[^/]+)\//);
  if (match) packages.add(match[1]);
}
const sections = [];
for (const name of [...packages].sort()) {
  const dir = join("node_modules", name);
  const meta = JSON.parse(readFileSync(join(dir, "package.json"), "utf8"));
  const file = readdirSync(dir).find((f) => /^(licen[cs]e|copying)/i.test(f));
  const text = file ? readFileSync(join(dir, file), "utf8").trim() : `License: ${meta.license} (no licence file shipped)`;
  sections.push(`${name} ${meta.version} (${meta.license})\n${"-".repeat(60)}\n${text}\n`);
}
writeFileSync(
  join(out, "agui-client.LICENSES.txt"),
  "agui-client.js bundles the following packages (esbuild, minified).\n\n" + sections.join("\n"),
);
console.log(`agui-client.js: ${[...packages].length} packages`);
