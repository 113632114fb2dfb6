/**
 * A chat that can be interrupted: every message is a turn submitted with
 * `onBusy: "interrupt"`, so a second message while the first is still answered
 * stops that turn and starts a new one, whose first step sees the stopped turn as
 * `ctx.previous` (its last durable state: what it had said so far).
 *
 *     TURND_URL=ws://127.0.0.1:7420/v1 node chat.js worker &
 *     node chat.js say "tell me a long story" &
 *     node chat.js say "actually, a short one"
 *
 * The reply is written one sentence per step (`Continue`), each streamed word by word
 * with `ctx.progress`; what a step said becomes durable with its `Continue` state.
 */
import { Continue, connect, isEvent, isProgress, Worker } from "turnd";

// One URL, or a cluster's nodes' URLs separated by commas.
const url = (process.env.TURND_URL ?? "ws://127.0.0.1:7420/v1").split(",").map((u) => u.trim());
const token = process.env.TURND_TOKEN;
const WORD_DELAY_MS = 50;

interface Reply {
  message: string;
  todo: string[];
  said: string;
}

/** The sentences of the answer (a model would write them). */
function planReply(message: string): string[] {
  return [
    `You said: ${message}.`,
    "That is worth a long answer.",
    "Here it comes, one sentence at a time.",
    "And that is all I have to say.",
  ];
}

async function serve(): Promise<void> {
  const worker = new Worker({ url, token, workerId: process.env.WORKER_ID ?? "chat-1" });
  worker.function("chat.reply", { concurrency: 16, timeoutMs: 60_000 }, async (ctx, input) => {
    if (ctx.step === 0) {
      const sentences = planReply(String(input));
      if (ctx.previous) {
        // The turn this message interrupted: its state is its last Continue (or, if
        // it never got that far, its input: the message).
        const before = ctx.previous.state as Partial<Reply> | string;
        const said = typeof before === "object" && before !== null ? (before.said ?? "") : "";
        sentences.unshift(`(You cut me off after: '${said.trim()}'.)`);
      }
      return new Continue({ message: String(input), todo: sentences, said: "" } satisfies Reply);
    }
    const state = input as Reply;
    const [sentence = "", ...todo] = state.todo;
    for (const [n, word] of sentence.split(" ").entries()) {
      await new Promise((resolve) => setTimeout(resolve, WORD_DELAY_MS));
      ctx.progress(n === 0 ? word : ` ${word}`);
    }
    const said = `${state.said}${sentence} `;
    if (todo.length === 0) return { reply: said.trim() };
    return new Continue({ ...state, todo, said } satisfies Reply);
  });
  worker.on("state", (state: string) => console.error(`[worker] ${state}`));
  await worker.run();
}

async function say(message: string): Promise<void> {
  const client = await connect({ url, token });
  try {
    const sessionId = process.env.SESSION_ID ?? "chat-1";
    const { turnId } = await client.submit(sessionId, "chat.reply", message, { onBusy: "interrupt" });
    for await (const item of await client.stream(turnId)) {
      if (isProgress(item)) process.stdout.write(String(item.data));
      else if (isEvent(item) && item.kind === "result" && item.detail.outcome === "continue") process.stdout.write(" ");
    }
    const turn = await client.get(turnId);
    console.log(`\n[${turn.status === "cancelled" ? (turn.stop?.reason ?? "cancelled") : turn.status}]`);
    if (turn.status === "completed") console.log(`reply: ${(turn.output as { reply: string }).reply}`);
  } finally {
    await client.close();
  }
}

if (process.argv[2] === "worker") await serve();
else await say(process.argv[3] ?? "hello");
