// The chat page: AG-UI over the app's /runs endpoint with @ag-ui/client's HttpAgent, the thread
// (a durable session on the server) rejoined on load through GET /threads/{id}.
import { HttpAgent } from "./agui-client.js";

const $ = (id) => document.getElementById(id);
const log = $("log");
const threadId = localStorage.getItem("trio_agent.thread") || `thread-${crypto.randomUUID()}`;
localStorage.setItem("trio_agent.thread", threadId);
$("thread").textContent = threadId;

// A server started with --token: open the page as http://host:port/#token=SECRET.
const token = new URLSearchParams(location.hash.slice(1)).get("token");
const headers = token ? { Authorization: `Bearer ${token}` } : {};
const agent = new HttpAgent({ url: "runs", threadId, headers });
// The browser's own tool: the agent may ask the page where it is (a client tool).
const clientTools = [
  { name: "where_am_i", description: "The page's location (its host)", parameters: { type: "object", properties: {} } },
];
let runId = null;

function add(kind, text) {
  const node = document.createElement("div");
  node.className = kind === "user" || kind === "assistant" ? `msg ${kind}` : kind;
  node.textContent = text;
  log.appendChild(node);
  log.scrollTop = log.scrollHeight;
  return node;
}

function setRunning(running) {
  $("status").textContent = running ? "running…" : "idle";
  $("stop").disabled = !running;
  $("send").disabled = running;
}

// One renderer for every AG-UI event, live or replayed.
const texts = new Map();
const tools = new Map();
function render(event) {
  switch (event.type) {
    case "MESSAGES_SNAPSHOT":
      log.replaceChildren();
      for (const message of event.messages) {
        if (message.role === "user") add("user", message.content);
        else if (message.role === "assistant") {
          if (message.content) add("assistant", message.content);
          for (const call of message.toolCalls || []) tools.set(call.id, add("tool", `${call.function.name}(${call.function.arguments})`));
        } else if (message.role === "tool") {
          const card = tools.get(message.toolCallId);
          if (card) card.textContent += ` → ${message.content}`;
        }
      }
      break;
    case "RUN_STARTED":
      runId = event.runId; // also for a run rejoined after a reload: Stop stops it
      setRunning(true);
      break;
    case "TEXT_MESSAGE_START":
      texts.set(event.messageId, add("assistant", ""));
      break;
    case "TEXT_MESSAGE_CONTENT": {
      const bubble = texts.get(event.messageId) || add("assistant", "");
      texts.set(event.messageId, bubble);
      bubble.textContent += event.delta;
      log.scrollTop = log.scrollHeight;
      break;
    }
    case "TOOL_CALL_START":
      tools.set(event.toolCallId, add("tool", `${event.toolCallName}(`));
      break;
    case "TOOL_CALL_ARGS":
      tools.get(event.toolCallId).textContent += event.delta;
      break;
    case "TOOL_CALL_END":
      tools.get(event.toolCallId).textContent += ")";
      break;
    case "TOOL_CALL_RESULT": {
      const card = tools.get(event.toolCallId) || add("tool", "tool");
      card.textContent += ` → ${event.content}`;
      break;
    }
    case "SUBAGENT_STARTED":
      add("subagent", `subagent ${event.name} started (${event.description || "foreground"})`).id = `sub-${event.subagentRunId}`;
      break;
    case "SUBAGENT_FINISHED":
    case "SUBAGENT_ERROR": {
      const card = document.getElementById(`sub-${event.subagentRunId}`) || add("subagent", "subagent");
      card.textContent += event.type === "SUBAGENT_ERROR" ? ` — failed: ${event.message}` : " — done";
      break;
    }
    case "CUSTOM":
      if (event.name === "trio_agent.thread_paused") ask(event.value.interrupts);
      break;
    case "RUN_FINISHED":
      setRunning(false);
      if (event.outcome && event.outcome.type === "interrupt") ask(event.outcome.interrupts);
      if (event.outcome && event.outcome.type === "cancelled") add("note", "stopped");
      break;
    case "RUN_ERROR":
      setRunning(false);
      add("note", `error: ${event.message}`);
      break;
  }
}

// A paused run: an approval gets Approve / Reject; a client tool is answered by the page itself.
function ask(interrupts) {
  const answers = [];
  const pending = new Set(interrupts.map((i) => i.id));
  const done = (answer) => {
    answers.push(answer);
    pending.delete(answer.interruptId);
    if (pending.size === 0) run({ resume: answers });
  };
  for (const interrupt of interrupts) {
    const meta = interrupt.metadata || {};
    if (meta.kind === "client_tool") {
      add("note", `answering ${meta.toolName} from the page`);
      done({ interruptId: interrupt.id, status: "resolved", payload: location.host });
      continue;
    }
    const card = add("question", `${interrupt.message || interrupt.reason}\n${meta.toolName || ""} ${JSON.stringify(meta.input || {})}`);
    card.dataset.interrupt = interrupt.id;
    for (const [label, approved] of [["Approve", true], ["Reject", false]]) {
      const button = document.createElement("button");
      button.textContent = label;
      button.onclick = () => {
        card.querySelectorAll("button").forEach((b) => (b.disabled = true));
        card.append(approved ? " ✔ approved" : " ✘ rejected");
        done({ interruptId: interrupt.id, status: "resolved", payload: approved ? { approved: true } : { approved: false, message: "rejected by the user" } });
      };
      card.appendChild(button);
    }
  }
}

async function run(parameters) {
  runId = crypto.randomUUID();
  try {
    await agent.runAgent({ runId, tools: clientTools, ...parameters }, { onEvent: ({ event }) => render(event) });
  } catch (error) {
    setRunning(false);
    add("note", `error: ${error.message || error}`);
  }
}

$("form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text) return;
  $("prompt").value = "";
  add("user", text);
  agent.messages.push({ id: crypto.randomUUID(), role: "user", content: text });
  run({});
});

$("stop").addEventListener("click", () => {
  if (runId) fetch(`runs/${encodeURIComponent(runId)}/abort`, { method: "POST", headers });
});

// On load: the thread as the server has it (a reload or a second tab), then its live run, if any.
async function rejoin() {
  const response = await fetch(`threads/${encodeURIComponent(threadId)}`, { headers });
  if (response.status === 404) return; // a new thread
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (frame.startsWith("data: ")) render(JSON.parse(frame.slice(6)));
    }
  }
}
rejoin();
