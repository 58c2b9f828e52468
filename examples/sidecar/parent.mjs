// An application's main process in miniature, for the tests: starts the sidecar, prints its pid and
// ready line as one JSON line, then lives on until it is killed (it never stops the server itself).
import { startSidecar } from "./sidecar.mjs";

const sidecar = await startSidecar({ bundle: process.env.EDGE_SPEC_BUNDLE, onLog: () => {} });
const { url, apiKey, model } = sidecar;
process.stdout.write(JSON.stringify({ pid: sidecar.process.pid, url, apiKey, model }) + "\n");
setInterval(() => {}, 60_000);
