// What the chat page imports from the AG-UI client.
export { HttpAgent } from "@ag-ui/client";
