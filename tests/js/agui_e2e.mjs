// @ag-ui/client against a running trio_agent endpoint (the offline agent): a whole run with a
// tool call that pauses for approval, then its continuation. Prints one JSON line of what it saw;
// exits non-zero (an assertion) if the stream is not what the protocol and the agent promise.
import assert from "node:assert/strict";
import { HttpAgent } from "@ag-ui/client";

const base = process.argv[2];
assert.ok(base, "usage: node agui_e2e.mjs http://127.0.0.1:PORT");

const agent = new HttpAgent({ url: `${base}/runs`, threadId: `node-${process.pid}` });

async function run(parameters) {
  const events = [];
  const result = await agent.runAgent(parameters, { onEvent: ({ event }) => { events.push(event); } });
  return { events, result, types: events.map((event) => event.type) };
}

agent.messages.push({ id: "u1", role: "user", content: "add 2 and 40" });
const first = await run({ runId: "node-run-1" });
assert.equal(first.types[0], "RUN_STARTED");
assert.equal(first.types.at(-1), "RUN_FINISHED");
const finished = first.events.at(-1);
assert.equal(finished.outcome.type, "interrupt");
const [question] = finished.outcome.interrupts;
assert.equal(question.metadata.kind, "approval");
assert.equal(question.metadata.toolName, "add");
assert.deepEqual(question.metadata.input, { a: 2, b: 40 });

const second = await run({
  runId: "node-run-2",
  resume: [{ interruptId: question.id, status: "resolved", payload: { approved: true } }],
});
assert.equal(second.types.at(-1), "RUN_FINISHED");
assert.equal(second.events.at(-1).outcome.type, "success");
const result = second.events.find((event) => event.type === "TOOL_CALL_RESULT");
assert.equal(result.toolCallId, question.toolCallId);
assert.equal(result.content, "42");
const text = second.events.filter((e) => e.type === "TEXT_MESSAGE_CONTENT").map((e) => e.delta).join("");
assert.equal(text, "The tool returned: 42");
// The client kept the conversation: the user's message, the call, its result and the answer.
const roles = agent.messages.map((message) => message.role);
assert.ok(roles.includes("tool") && roles.at(-1) === "assistant", JSON.stringify(roles));

console.log(JSON.stringify({ first: first.types, second: second.types, text, messages: roles }));
