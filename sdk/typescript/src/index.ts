/**
 * turnd for Node: workers that serve functions and callers that run turns, over
 * protocol v1. See docs/sdk-typescript.md.
 */
export {
  Client,
  type ClientOptions,
  type ClientState,
  connect,
  type OnBusy,
  type ResumeOptions,
  type SubmitOptions,
  type WatchOptions,
  WatchStream,
  type WatchTarget,
} from "./client.js";
export { CLOSE_SUPERSEDED, Connection, type HelloOk, PROTOCOL_VERSION } from "./connection.js";
export { BadUrl, BusyError, ConnectionError, type ErrorCode, TurndError } from "./errors.js";
export {
  Cancelled,
  Continue,
  Fail,
  type FunctionOptions,
  type Handler,
  type Previous,
  type Resumed,
  resumed,
  Suspend,
  type SuspendOptions,
  type TurnContext,
} from "./handler.js";
export * from "./types.js";
export {
  Worker,
  type WorkerOptions,
  type WorkerState,
  type WorkerStats,
} from "./worker.js";
