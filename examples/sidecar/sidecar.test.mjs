// node --test examples/sidecar/   (EDGE_SPEC_BUNDLE: a bundle; EDGE_SPEC_COMMAND: see sidecar.mjs)
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { readFileSync } from "node:fs";
import { createInterface } from "node:readline";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { startSidecar, streamChat } from "./sidecar.mjs";

const bundle = process.env.EDGE_SPEC_BUNDLE;
const skip = bundle ? false : "EDGE_SPEC_BUNDLE names no bundle";
const EXIT_MS = 2000;

/** No such process, or only its exit status left (a zombie, where init does not reap). */
function gone(pid) {
  try {
    process.kill(pid, 0);
  } catch (error) {
    return error.code === "ESRCH";
  }
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    return stat.slice(stat.lastIndexOf(")") + 2).startsWith("Z");
  } catch {
    return false;
  }
}

async function waitGone(pid, timeoutMs) {
  const started = Date.now();
  while (Date.now() - started < timeoutMs) {
    if (gone(pid)) return Date.now() - started;
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  return null;
}

test("prints one ready line, streams an answer, stops", { skip }, async () => {
  const sidecar = await startSidecar({ bundle, onLog: () => {} });
  try {
    assert.match(sidecar.url, /^http:\/\/127\.0\.0\.1:\d+$/);
    assert.ok(sidecar.apiKey.length >= 32);
    let text = "";
    let chunks = 0;
    for await (const piece of streamChat(sidecar, [{ role: "user", content: "def is_prime(n):" }], { maxTokens: 16 })) {
      text += piece;
      chunks += 1;
    }
    assert.ok(chunks > 1 && text.length > 0, `streamed ${chunks} chunks: ${JSON.stringify(text)}`);
  } finally {
    await sidecar.stop();
  }
  assert.ok(gone(sidecar.process.pid));
});

test("refuses requests without this launch's key", { skip }, async () => {
  const sidecar = await startSidecar({ bundle, onLog: () => {} });
  try {
    const response = await fetch(`${sidecar.url}/v1/models`);
    assert.equal(response.status, 401);
    const models = await fetch(`${sidecar.url}/v1/models`, { headers: { Authorization: `Bearer ${sidecar.apiKey}` } });
    assert.equal((await models.json()).data[0].id, sidecar.model);
  } finally {
    await sidecar.stop();
  }
});

test("exits within 2 s when its parent is killed, leaving no process", { skip }, async () => {
  const parentScript = fileURLToPath(new URL("./parent.mjs", import.meta.url));
  const parent = spawn(process.execPath, [parentScript], { stdio: ["ignore", "pipe", "inherit"] });
  const [line] = await new Promise((resolve, reject) => {
    createInterface({ input: parent.stdout }).once("line", (l) => resolve([l]));
    parent.once("exit", (code) => reject(new Error(`the parent exited (${code}) before the server was ready`)));
  });
  const server = JSON.parse(line);
  assert.equal((await fetch(`${server.url}/health`)).status, 200);
  const exited = new Promise((resolve) => parent.once("exit", resolve));
  parent.kill("SIGKILL");
  await exited;
  const took = await waitGone(server.pid, 10_000);
  console.log(`server gone ${took} ms after its parent was killed`);
  if (took === null) process.kill(server.pid, "SIGKILL");
  assert.ok(took !== null && took < EXIT_MS, `server still there ${took ?? "10000+"} ms after its parent died`);
  await assert.rejects(fetch(`${server.url}/health`));
});
