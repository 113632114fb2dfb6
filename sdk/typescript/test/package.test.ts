/**
 * The package as a user installs it: `npm pack` of this folder (or the tarball of
 * `make sdk`, given as `$TURND_SDK_TARBALL`) installed with `npm install` into a
 * fresh project outside the checkout, with only the registry besides. A script that
 * imports `turnd` and `turnd/testing` type-checks (strict, with `@types/node`) and
 * runs a turn against the daemon, loading the SDK and its `ws` from that project.
 */
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { lstat, mkdir, mkdtemp, readFile, realpath, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { it } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

const run = promisify(execFile);
/** This package's folder (the test runs from build/sdk/typescript/test). */
const pkgDir = fileURLToPath(new URL("../../../../", import.meta.url));
const npm = process.platform === "win32" ? "npm.cmd" : "npm";

const MAIN_TS = `import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";
import { connect, type TurnContext, Worker } from "turnd";
import { startTurnd } from "turnd/testing";

const turnd = await startTurnd();
const worker = new Worker({ url: turnd.url, workerId: "user-worker" });
worker.function("echo", async (_ctx: TurnContext, input: { hello: string }) => input);
await worker.start();
const client = await connect({ url: turnd.url });
const turn = await client.submit("user-session", "echo", { hello: "world" });
const done = await client.wait(turn.turnId, { timeoutMs: 10_000 });
const sdk = fileURLToPath(import.meta.resolve("turnd"));
console.log(JSON.stringify({ status: done.status, output: done.output, sdk, ws: createRequire(sdk).resolve("ws") }));
await client.close();
await worker.stop();
await turnd.stop();
`;

const TSCONFIG = {
  compilerOptions: {
    target: "ES2022",
    module: "NodeNext",
    moduleResolution: "NodeNext",
    types: ["node"],
    strict: true,
    outDir: "out",
  },
  files: ["main.ts"],
};

async function tarball(work: string): Promise<string> {
  const given = process.env.TURND_SDK_TARBALL;
  if (given) return given;
  // What `make sdk` does, with dist/ as the test command built it.
  const { stdout } = await run(npm, ["pack", "--ignore-scripts", "--silent", "--pack-destination", work], {
    cwd: pkgDir,
  });
  return join(work, stdout.trim().split("\n").pop() ?? "");
}

it("installs from the tarball alone, type-checks and runs a turn", { timeout: 110_000 }, async () => {
  const work = await realpath(await mkdtemp(join(tmpdir(), "turnd-user-")));
  try {
    const tgz = await tarball(work);
    const project = join(work, "project");
    await mkdir(project);
    const dev = (JSON.parse(await readFile(join(pkgDir, "package.json"), "utf8")) as {
      devDependencies: Record<string, string>;
    }).devDependencies;
    await writeFile(join(project, "package.json"), JSON.stringify({ name: "user-project", private: true, type: "module" }));
    await writeFile(join(project, "tsconfig.json"), JSON.stringify(TSCONFIG));
    await writeFile(join(project, "main.ts"), MAIN_TS);
    await run(
      npm,
      [
        "install",
        "--no-audit",
        "--no-fund",
        "--prefer-offline",
        tgz,
        `@types/node@${dev["@types/node"]}`,
        `typescript@${dev.typescript}`,
      ],
      { cwd: project },
    );

    // A copy, not a link to the checkout, with its compiled code and nothing to build.
    const installed = join(project, "node_modules", "turnd");
    assert.equal((await lstat(installed)).isSymbolicLink(), false);
    const manifest = JSON.parse(await readFile(join(installed, "package.json"), "utf8")) as {
      scripts?: Record<string, string>;
      dependencies?: Record<string, string>;
    };
    for (const hook of ["preinstall", "install", "postinstall", "prepare"]) {
      assert.equal(manifest.scripts?.[hook], undefined, `the package has a ${hook} script`);
    }
    assert.ok(manifest.dependencies?.ws, "ws is not a dependency of the package");

    await run(process.execPath, [join(project, "node_modules", "typescript", "bin", "tsc"), "-p", project], {
      cwd: project,
    });
    const { stdout } = await run(process.execPath, [join(project, "out", "main.js")], { cwd: project });
    const got = JSON.parse(stdout) as { status: string; output: unknown; sdk: string; ws: string };
    assert.equal(got.status, "completed");
    assert.deepEqual(got.output, { hello: "world" });
    assert.equal(got.sdk, join(installed, "dist", "index.js"));
    assert.equal(got.ws, join(project, "node_modules", "ws", "index.js"));
  } finally {
    await rm(work, { recursive: true, force: true });
  }
});
