#!/usr/bin/env node
// An offline ACP agent for bmx's tests and benchmarks, written with the
// official ACP TypeScript SDK (@agentclientprotocol/sdk, pinned in
// ../package.json). It speaks ACP v1 over stdio (newline-delimited JSON-RPC)
// and needs no network and no key: what it does is chosen by the text of the
// prompt, so a test can make it stream, call a tool, ask a permission, run
// long, crash, write garbage or resume.
//
//   node tests/peers/agent/test-agent.mjs
//
// Prompt text (the text blocks of `session/prompt`, joined, trimmed):
//
//   P (anything else)  agent_thought_chunk "thinking about P"; agent_message_chunk
//                      "Hello", ", ", "you said: P" (three notifications); a
//                      tool_call tc-1 ("read a file", kind read, pending,
//                      rawInput {path: "note.txt"}), then its tool_call_update
//                      (completed, text "file contents"); stopReason end_turn.
//   permission…        tool_call tc-perm ("write a file", kind edit, rawInput
//                      {path: "out.txt"}), then session/request_permission with
//                      the options allow_once, allow_always, reject_once. Allowed:
//                      chunk "allowed" and tc-perm completed; rejected or
//                      cancelled: chunk "denied" and tc-perm failed. end_turn
//                      (cancelled if session/cancel came meanwhile).
//   slow               a chunk "tick N" every 200 ms for 30 s; session/cancel
//                      stops it with stopReason cancelled.
//   crash              one chunk "about to crash", then exit status 3 mid-turn.
//   garbage            a line that is not JSON on stdout, then as the default.
//   many N             N chunks of 32 bytes as fast as the pipe takes them,
//                      then end_turn (N at most 10 000 000).
//   paced N MS         N chunks "at T", one every MS ms (N at most 100 000,
//                      MS at most 10 000), T the monotonic clock in ns at the
//                      write (process.hrtime: CLOCK_MONOTONIC, the clock a
//                      reader on this machine can compare with); for latency.
//   history            one chunk "prompts so far: N", N counting every prompt
//                      this session has had, this one included (proves
//                      `session/load` after a restart of the agent).
//
// Sessions are kept in <cwd>/.test-agent/<sessionId>.json (cwd from
// session/new or session/load), so `session/load` works across restarts of
// the agent; an unknown id is a JSON-RPC error (-32002, resource not found).
// With TEST_AGENT_REPLAY=1, session/load replays the history as
// user_message_chunk / agent_message_chunk updates, as ACP lets an agent do.
// TEST_AGENT_LOG=1 logs every request on stderr.

import { Readable, Writable } from "node:stream";
import { randomUUID } from "node:crypto";
import fs from "node:fs";
import path from "node:path";
import * as acp from "@agentclientprotocol/sdk";

const log = process.env.TEST_AGENT_LOG === "1"
  ? (...args) => process.stderr.write(`test-agent: ${args.join(" ")}\n`)
  : () => {};

/** sessionId -> { cwd, prompts: [string], replies: [string], cancel: null | () => void, cancelled: bool } */
const sessions = new Map();

function sessionFile(cwd, sessionId) {
  return path.join(cwd, ".test-agent", `${sessionId}.json`);
}

function persist(sessionId) {
  const s = sessions.get(sessionId);
  const file = sessionFile(s.cwd, sessionId);
  fs.mkdirSync(path.dirname(file), { recursive: true });
  fs.writeFileSync(file, JSON.stringify({ sessionId, prompts: s.prompts, replies: s.replies }));
}

function validId(id) {
  return typeof id === "string" && /^[A-Za-z0-9_-]{1,128}$/.test(id);
}

function promptText(prompt) {
  return (prompt ?? [])
    .filter((b) => b && b.type === "text" && typeof b.text === "string")
    .map((b) => b.text)
    .join("")
    .trim();
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const app = acp.agent({ name: "bmx-test-agent" });

app.onRequest(acp.methods.agent.initialize, ({ params }) => {
  log("initialize", JSON.stringify(params));
  return {
    protocolVersion: 1,
    agentCapabilities: { loadSession: true },
    agentInfo: { name: "bmx-test-agent", version: "1.0.0" },
    authMethods: [],
  };
});

app.onRequest(acp.methods.agent.session.new, ({ params }) => {
  const sessionId = `ta-${randomUUID()}`;
  const cwd = typeof params.cwd === "string" && params.cwd ? params.cwd : process.cwd();
  sessions.set(sessionId, { cwd, prompts: [], replies: [], cancel: null, cancelled: false });
  persist(sessionId);
  log("session/new", sessionId, cwd);
  return { sessionId };
});

app.onRequest(acp.methods.agent.session.load, async ({ params, client }) => {
  const { sessionId } = params;
  const cwd = typeof params.cwd === "string" && params.cwd ? params.cwd : process.cwd();
  log("session/load", sessionId, cwd);
  if (!validId(sessionId)) throw acp.RequestError.sessionNotFound(String(sessionId));
  let stored;
  try {
    stored = JSON.parse(fs.readFileSync(sessionFile(cwd, sessionId), "utf8"));
  } catch {
    throw acp.RequestError.sessionNotFound(sessionId);
  }
  const prompts = Array.isArray(stored.prompts) ? stored.prompts : [];
  const replies = Array.isArray(stored.replies) ? stored.replies : [];
  sessions.set(sessionId, { cwd, prompts, replies, cancel: null, cancelled: false });
  if (process.env.TEST_AGENT_REPLAY === "1") {
    for (let i = 0; i < prompts.length; i++) {
      await update(client, sessionId, { sessionUpdate: "user_message_chunk", content: { type: "text", text: prompts[i] } });
      if (replies[i] !== undefined) {
        await update(client, sessionId, { sessionUpdate: "agent_message_chunk", content: { type: "text", text: replies[i] } });
      }
    }
  }
  return {};
});

app.onNotification(acp.methods.agent.session.cancel, ({ params }) => {
  log("session/cancel", params.sessionId);
  const s = sessions.get(params.sessionId);
  if (!s) return;
  s.cancelled = true;
  if (s.cancel) s.cancel();
});

function update(client, sessionId, u) {
  return client.notify(acp.methods.client.session.update, { sessionId, update: u });
}

function chunk(client, sessionId, text) {
  return update(client, sessionId, { sessionUpdate: "agent_message_chunk", content: { type: "text", text } });
}

/** Resolves after `ms`, or at once when the session is cancelled; true if cancelled. */
function waitOrCancel(s, ms) {
  if (s.cancelled) return Promise.resolve(true);
  return new Promise((resolve) => {
    const timer = setTimeout(() => {
      s.cancel = null;
      resolve(false);
    }, ms);
    s.cancel = () => {
      clearTimeout(timer);
      s.cancel = null;
      resolve(true);
    };
  });
}

async function defaultTurn(client, sessionId, text) {
  await update(client, sessionId, {
    sessionUpdate: "agent_thought_chunk",
    content: { type: "text", text: `thinking about ${text}` },
  });
  for (const part of ["Hello", ", ", `you said: ${text}`]) await chunk(client, sessionId, part);
  await update(client, sessionId, {
    sessionUpdate: "tool_call",
    toolCallId: "tc-1",
    title: "read a file",
    kind: "read",
    status: "pending",
    rawInput: { path: "note.txt" },
  });
  await update(client, sessionId, {
    sessionUpdate: "tool_call_update",
    toolCallId: "tc-1",
    status: "completed",
    content: [{ type: "content", content: { type: "text", text: "file contents" } }],
  });
  return `Hello, you said: ${text}`;
}

async function permissionTurn(client, sessionId, s) {
  const toolCall = {
    toolCallId: "tc-perm",
    title: "write a file",
    kind: "edit",
    status: "pending",
    rawInput: { path: "out.txt" },
  };
  await update(client, sessionId, { sessionUpdate: "tool_call", ...toolCall });
  let allowed = false;
  try {
    const answer = await client.request(acp.methods.client.session.requestPermission, {
      sessionId,
      toolCall,
      options: [
        { optionId: "allow_once", name: "Allow once", kind: "allow_once" },
        { optionId: "allow_always", name: "Always allow", kind: "allow_always" },
        { optionId: "reject_once", name: "Reject", kind: "reject_once" },
      ],
    });
    log("permission answer", JSON.stringify(answer));
    const outcome = answer?.outcome;
    allowed = outcome?.outcome === "selected" && typeof outcome.optionId === "string" && outcome.optionId.startsWith("allow");
  } catch (e) {
    log("permission request failed", String(e));
    allowed = false;
  }
  const reply = allowed ? "allowed" : "denied";
  await chunk(client, sessionId, reply);
  await update(client, sessionId, {
    sessionUpdate: "tool_call_update",
    toolCallId: "tc-perm",
    status: allowed ? "completed" : "failed",
    content: [{ type: "content", content: { type: "text", text: allowed ? "wrote out.txt" : "permission denied" } }],
  });
  return reply;
}

app.onRequest(acp.methods.agent.session.prompt, async ({ params, client }) => {
  const { sessionId } = params;
  const s = sessions.get(sessionId);
  if (!s) throw acp.RequestError.sessionNotFound(String(sessionId));
  const text = promptText(params.prompt);
  log("session/prompt", sessionId, JSON.stringify(text));
  s.cancelled = false;
  s.prompts.push(text);
  persist(sessionId);
  let reply = "";
  let stopReason = "end_turn";

  if (text.startsWith("permission")) {
    reply = await permissionTurn(client, sessionId, s);
  } else if (text === "slow" || text.startsWith("slow ")) {
    const started = Date.now();
    for (let n = 1; Date.now() - started < 30_000; n++) {
      if (await waitOrCancel(s, 200)) break;
      await chunk(client, sessionId, `tick ${n}`);
      reply = `tick ${n}`;
    }
  } else if (text === "crash" || text.startsWith("crash ")) {
    await chunk(client, sessionId, "about to crash");
    // Give the chunk time to leave the pipe before dying mid-turn.
    await sleep(100);
    process.exit(3);
  } else if (text === "garbage" || text.startsWith("garbage ")) {
    process.stdout.write("this line is not JSON {{{\n");
    reply = await defaultTurn(client, sessionId, text);
  } else if (/^many \d+$/.test(text)) {
    const n = Math.min(Number(text.slice(5)), 10_000_000);
    for (let i = 0; i < n; i++) {
      // 32 bytes of text: "chunk " + a 10-digit index + 16 filler bytes.
      await chunk(client, sessionId, `chunk ${String(i).padStart(10, "0")} ${"x".repeat(15)}`);
      if (s.cancelled) break;
    }
    reply = `${n} chunks`;
  } else if (/^paced \d+ \d+$/.test(text)) {
    const [, n, ms] = text.split(" ").map(Number);
    const count = Math.min(n, 100_000);
    for (let i = 0; i < count && !s.cancelled; i++) {
      if (await waitOrCancel(s, Math.min(ms, 10_000))) break;
      await chunk(client, sessionId, `at ${process.hrtime.bigint()}`);
    }
    reply = `${count} paced chunks`;
  } else if (text === "history") {
    reply = `prompts so far: ${s.prompts.length}`;
    await chunk(client, sessionId, reply);
  } else {
    reply = await defaultTurn(client, sessionId, text);
  }

  if (s.cancelled) stopReason = "cancelled";
  s.cancelled = false;
  s.replies.push(reply);
  persist(sessionId);
  log("session/prompt done", sessionId, stopReason);
  return { stopReason };
});

const stream = acp.ndJsonStream(Writable.toWeb(process.stdout), Readable.toWeb(process.stdin));
const connection = app.connect(stream);
connection.closed.then(
  () => process.exit(0),
  () => process.exit(0),
);
