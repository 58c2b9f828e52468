// edge-spec as the sidecar of a Node application (an Electron main process, a VS Code extension):
// start `edge-spec serve` as a child process, read the one JSON line it prints once it listens, stream
// answers from its OpenAI-compatible API with fetch, and stop it. Node 18 or later; no dependencies.
//
//   node examples/sidecar/sidecar.mjs [BUNDLE] "Write quicksort in Python"
//
// EDGE_SPEC_COMMAND (a JSON array, default ["edge-spec", "serve"]) names the command that starts the
// server, e.g. ["/path/to/venv/bin/python", "-m", "edge_spec.cli", "serve"] or a frozen build's binary.

import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

export const DEFAULT_COMMAND = ["edge-spec", "serve"];

/** The command that starts the server: EDGE_SPEC_COMMAND, else `edge-spec serve`. */
export function serveCommand(env = process.env) {
  return env.EDGE_SPEC_COMMAND ? JSON.parse(env.EDGE_SPEC_COMMAND) : DEFAULT_COMMAND;
}

/**
 * Start the server and wait until it listens. Resolves to {url, apiKey, model, process, stop()}.
 *
 * --port 0: the system picks a free port; --api-key auto: a key for this launch only, so other local
 * programs and web pages cannot use the model; --exit-with-parent: the server exits when this process
 * dies, even when it is killed and never calls stop(). stdin stays a pipe: its closing is one of the
 * signs the server watches. The server's log (stderr) goes to this process's stderr unless `onLog` is
 * given; it must be read or dropped, never left in a pipe nobody reads (the server would block on it).
 */
export function startSidecar({
  bundle,
  command = serveCommand(),
  args = [],
  onLog,
  timeoutMs = 180_000,
} = {}) {
  const [program, ...rest] = command;
  const argv = [...rest, ...(bundle ? [bundle] : []), "--port", "0", "--api-key", "auto", "--exit-with-parent", ...args];
  const child = spawn(program, argv, { stdio: ["pipe", "pipe", onLog ? "pipe" : "inherit"], windowsHide: true });
  if (onLog) createInterface({ input: child.stderr }).on("line", onLog);

  return new Promise((resolve, reject) => {
    const lines = createInterface({ input: child.stdout });
    const timer = setTimeout(() => fail(new Error(`edge-spec serve was not ready after ${timeoutMs} ms`)), timeoutMs);
    const onExit = (code, signal) => fail(new Error(`edge-spec serve exited (${signal ?? `code ${code}`}) before it was ready`));
    const onError = (error) => fail(new Error(`cannot start ${program}: ${error.message}`));

    function done() {
      clearTimeout(timer);
      child.off("exit", onExit);
      child.off("error", onError);
      lines.removeAllListeners("line");
    }
    function fail(error) {
      done();
      child.kill("SIGKILL");
      reject(error);
    }
    child.once("exit", onExit);
    child.once("error", onError);
    lines.once("line", (line) => {
      done();
      let ready;
      try {
        ready = JSON.parse(line);
      } catch {
        return fail(new Error(`not a ready line: ${line}`));
      }
      child.stdout.resume(); // nothing else comes on stdout; keep it drained all the same
      resolve({
        url: ready.url,
        apiKey: ready.api_key,
        model: ready.model,
        process: child,
        stop: () => stopSidecar(child),
      });
    });
  });
}

/** Ask the server to stop (SIGTERM: it finishes in order), and kill it if it takes longer than graceMs. */
export function stopSidecar(child, graceMs = 15_000) {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve();
  return new Promise((resolve) => {
    const timer = setTimeout(() => child.kill("SIGKILL"), graceMs);
    child.once("exit", () => {
      clearTimeout(timer);
      resolve();
    });
    child.kill("SIGTERM");
  });
}

/**
 * Stream a chat answer: yields its text as it comes. `signal` (an AbortSignal) stops it; the server
 * then stops generating at its next token.
 */
export async function* streamChat({ url, apiKey, model }, messages, { maxTokens = 512, temperature = 0, signal } = {}) {
  const response = await fetch(`${url}/v1/chat/completions`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${apiKey}` },
    body: JSON.stringify({ model, messages, stream: true, max_tokens: maxTokens, temperature }),
    signal,
  });
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    throw new Error(`HTTP ${response.status}: ${body.error?.message ?? response.statusText}`);
  }
  const decoder = new TextDecoder();
  let buffer = "";
  for await (const bytes of response.body) {
    buffer += decoder.decode(bytes, { stream: true }).replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const text = chunk.choices?.[0]?.delta?.content;
        if (text) yield text;
      }
    }
  }
}

async function main(argv) {
  const [first, second] = argv;
  const [bundle, prompt] = second === undefined ? [undefined, first] : [first, second];
  if (!prompt) {
    console.error('usage: node sidecar.mjs [BUNDLE] "prompt"');
    process.exit(2);
  }
  const sidecar = await startSidecar({ bundle, onLog: () => {} });
  try {
    for await (const text of streamChat(sidecar, [{ role: "user", content: prompt }])) {
      process.stdout.write(text);
    }
    process.stdout.write("\n");
  } finally {
    await sidecar.stop();
  }
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  main(process.argv.slice(2)).catch((error) => {
    console.error(`error: ${error.message}`);
    process.exit(1);
  });
}
