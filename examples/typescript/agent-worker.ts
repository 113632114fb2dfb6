/**
 * An agent-style worker: one turn is a conversation step that may take several
 * model/tool round trips. Each round trip is one step of the turn: the handler
 * returns `new Continue(state)` to run the next step with `state` as its input, and
 * a plain value when the agent has its answer. turnd stores the state between
 * steps, so a worker crash or a daemon restart resumes the turn at its last step.
 *
 *     TURND_URL=ws://127.0.0.1:7420/v1 node agent-worker.js
 *
 * The "model" here is a tiny rule-based planner so the example runs offline; put a
 * real model call in `plan()`.
 */
import { Continue, Fail, type TurnContext, Worker } from "turnd";

interface AgentState {
  question: string;
  /** Tool results gathered so far. */
  notes: string[];
  /** Tools the plan still wants to call. */
  pending?: string[];
}

type Input = { question: string } | AgentState;

// One URL, or a cluster's nodes' URLs separated by commas.
const url = (process.env.TURND_URL ?? "ws://127.0.0.1:7420/v1").split(",").map((u) => u.trim());
const worker = new Worker({
  url,
  workerId: process.env.WORKER_ID ?? "agent-1",
  log: (level, message) => {
    if (level !== "debug") console.error(`[worker ${level}] ${message}`);
  },
});

/** Decide which tools to call for a question (the model's job in a real agent). */
function plan(question: string): string[] {
  const tools: string[] = [];
  if (/\d+\s*[-+*/]\s*\d+/.test(question)) tools.push("calculator");
  if (/time|date/i.test(question)) tools.push("clock");
  return tools;
}

/** Run one tool. `key` is the same for every attempt of this step: use it to dedupe side effects. */
async function callTool(tool: string, question: string, key: string, signal: AbortSignal): Promise<string> {
  await new Promise((resolve) => setTimeout(resolve, 50)); // stands for network latency
  signal.throwIfAborted();
  switch (tool) {
    case "calculator": {
      const m = /(\d+)\s*([-+*/])\s*(\d+)/.exec(question);
      if (!m) throw new Fail("tool_input", "no arithmetic found");
      const [a, op, b] = [Number(m[1]), m[2], Number(m[3])];
      const value = op === "+" ? a + b : op === "-" ? a - b : op === "*" ? a * b : a / b;
      return `calculator(${a} ${op} ${b}) = ${value} [${key}]`;
    }
    case "clock":
      return `clock() = ${new Date().toISOString()} [${key}]`;
    default:
      throw new Fail("unknown_tool", `no tool named ${tool}`);
  }
}

worker.function(
  "agent.step",
  // A step may run long (a model call): heartbeats keep it alive past timeoutMs, and
  // at_least_once lets turnd run a step again when its outcome was lost.
  { concurrency: 8, timeoutMs: 30_000, delivery: "at_least_once", maxAttempts: 3 },
  async (ctx: TurnContext, input: Input) => {
    const state: AgentState =
      "notes" in input ? input : { question: input.question, notes: [], pending: plan(input.question) };
    const [tool, ...rest] = state.pending ?? [];
    if (tool !== undefined) {
      console.error(`[${ctx.sessionId} step ${ctx.step}] calling ${tool}`);
      const note = await callTool(tool, state.question, ctx.idempotencyKey, ctx.signal);
      return new Continue({ question: state.question, notes: [...state.notes, note], pending: rest });
    }
    const reply =
      state.notes.length > 0
        ? `Here is what I found: ${state.notes.join("; ")}`
        : `I have no tool for "${state.question}", but I heard you.`;
    return { reply, steps: ctx.step + 1 };
  },
);

worker.on("state", (state: string) => console.error(`[worker] ${state}`));
await worker.run(); // until SIGTERM/SIGINT, then drain
