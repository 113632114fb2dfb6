/**
 * A caller: sends a question to the agent as a turn, follows its progress through a
 * watch, and prints the answer.
 *
 *     TURND_URL=ws://127.0.0.1:7420/v1 node caller.js "what is 6 * 7 and the time?"
 */
import { connect } from "turnd";

// One URL, or a cluster's nodes' URLs separated by commas.
const url = (process.env.TURND_URL ?? "ws://127.0.0.1:7420/v1").split(",").map((u) => u.trim());
const question = process.argv[2] ?? "what is 6 * 7?";
const sessionId = process.env.SESSION_ID ?? "conversation-1";

const client = await connect({ url, token: process.env.TURND_TOKEN });
try {
  // The idempotency key makes a retried submit (say, after a crash of this script)
  // return the same turn instead of asking twice.
  const turn = await client.submit(
    sessionId,
    "agent.step",
    { question },
    {
      idempotencyKey: `${sessionId}:${question}`,
      turnTimeoutMs: 120_000,
    },
  );
  console.log(`turn ${turn.turnId} (${turn.deduplicated ? "already submitted" : "new"}), ${turn.status}`);

  // From the turn's first event, so nothing that happened before the watch is missed.
  const events = await client.watch({ turnId: turn.turnId }, { after: 0 });
  for await (const event of events) {
    console.log(`  #${event.seq} ${event.kind}${"step" in event.detail ? ` step ${event.detail.step}` : ""}`);
    if (event.kind === "completed" || event.kind === "failed" || event.kind === "cancelled") break;
  }

  const done = await client.wait(turn.turnId);
  if (done.status === "completed") {
    console.log((done.output as { reply: string }).reply);
  } else {
    console.log(`turn ${done.status}: ${done.error?.cause ?? done.stop?.reason}`);
    process.exitCode = 1;
  }
} finally {
  await client.close();
}
