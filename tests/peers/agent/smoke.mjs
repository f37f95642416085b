#!/usr/bin/env node
// A quick check of test-agent.mjs with the SDK's client side, by hand:
//
//   node tests/peers/agent/smoke.mjs [prompt...]
//
// Starts the agent in a temporary directory, opens a session, sends each
// prompt (default: "hi"), prints every update and the stop reason as JSON
// lines, answers permissions with $SMOKE_PERMISSION (allow_once by default,
// "cancelled" to cancel), and with the prompt "restart" stops the agent and
// loads the session in a fresh one.

import { spawn } from "node:child_process";
import { Readable, Writable } from "node:stream";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import * as acp from "@agentclientprotocol/sdk";

const here = path.dirname(fileURLToPath(import.meta.url));
const cwd = fs.mkdtempSync(path.join(os.tmpdir(), "test-agent-"));
const prompts = process.argv.length > 2 ? process.argv.slice(2) : ["hi"];
const out = (o) => process.stdout.write(JSON.stringify(o) + "\n");

function start() {
  const child = spawn(process.execPath, [path.join(here, "test-agent.mjs")], {
    cwd,
    stdio: ["pipe", "pipe", "inherit"],
  });
  child.on("exit", (code) => out({ agentExit: code }));
  const app = acp
    .client({ name: "smoke" })
    .onNotification(acp.methods.client.session.update, ({ params }) => out({ update: params.update }))
    .onRequest(acp.methods.client.session.requestPermission, ({ params }) => {
      out({ permission: params });
      const choice = process.env.SMOKE_PERMISSION ?? "allow_once";
      return choice === "cancelled"
        ? { outcome: { outcome: "cancelled" } }
        : { outcome: { outcome: "selected", optionId: choice } };
    });
  const conn = app.connect(acp.ndJsonStream(Writable.toWeb(child.stdin), Readable.toWeb(child.stdout)));
  return { child, agent: conn.agent };
}

let { child, agent } = start();
out({ initialize: await agent.request(acp.methods.agent.initialize, { protocolVersion: 1, clientCapabilities: {} }) });
const { sessionId } = await agent.request(acp.methods.agent.session.new, { cwd, mcpServers: [] });
out({ sessionId });
for (const text of prompts) {
  if (text === "restart") {
    child.kill();
    ({ child, agent } = start());
    await agent.request(acp.methods.agent.initialize, { protocolVersion: 1, clientCapabilities: {} });
    out({ load: await agent.request(acp.methods.agent.session.load, { sessionId, cwd, mcpServers: [] }) });
    continue;
  }
  const pending = agent.request(acp.methods.agent.session.prompt, { sessionId, prompt: [{ type: "text", text }] });
  if (text === "slow") {
    setTimeout(() => agent.notify(acp.methods.agent.session.cancel, { sessionId }), 700);
  }
  try {
    out({ stop: await pending });
  } catch (e) {
    out({ error: String(e?.message ?? e), code: e?.code });
  }
}
child.kill();
fs.rmSync(cwd, { recursive: true, force: true });
process.exit(0);
