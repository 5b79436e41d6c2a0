// @ag-ui/client posting a thread's run again (a client coming back): prints one JSON line, the
// event types it was given and the error it raised, if any (it refuses a stream whose first event
// is neither RUN_STARTED nor RUN_ERROR).
import { HttpAgent } from "@ag-ui/client";

const [base, threadId, runId, prompt] = process.argv.slice(2);
const agent = new HttpAgent({ url: `${base}/runs`, threadId });
agent.messages.push({ id: "u1", role: "user", content: prompt });
const types = [];
let error = null;
try {
  await agent.runAgent({ runId }, { onEvent: ({ event }) => { types.push(event.type); } });
} catch (raised) {
  error = String(raised.message || raised);
}
console.log(JSON.stringify({ types, error }));
