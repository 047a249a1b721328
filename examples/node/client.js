#!/usr/bin/env node
// A small Node.js client of the TGIS API (fmaas.GenerationService), through @grpc/grpc-js
// and @grpc/proto-loader: the proto file is loaded at run time, no code generation, no build.
//
//   npm ci
//   node client.js                                   # against `make run` on 127.0.0.1:8033
//   node client.js --target host:8033 --max-new-tokens 30 --prompt "Once upon a time"
//   node client.js --target localhost:8033 --ca ca.pem [--cert client.pem --key client.key]
//   node client.js --json                            # one JSON object on stdout
//
// It calls ModelInfo, a unary Generate of every --prompt (greedy), and a GenerateStream of
// the first one. A failed call prints `error: <gRPC status>: <message>` on stderr, exit code 1.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const DEFAULT_PROMPTS = ['Return the number of', 'Once upon a time'];
const PROTO = path.join(__dirname, '..', '..', 'protos', 'generation.proto');

const USAGE = `usage: node client.js [--target host:port] [--prompt TEXT]... [--max-new-tokens N]
       [--ca ca.pem [--cert client.pem --key client.key]] [--proto generation.proto]
       [--timeout SECONDS] [--json]`;

function options() {
  const { values } = parseArgs({
    options: {
      target: { type: 'string', default: '127.0.0.1:8033' },
      prompt: { type: 'string', multiple: true, default: DEFAULT_PROMPTS },
      'max-new-tokens': { type: 'string', default: '20' },
      proto: { type: 'string', default: PROTO }, // the repository's, by default
      ca: { type: 'string' }, // CA certificate (PEM): use TLS
      cert: { type: 'string' }, // client certificate (PEM): mTLS
      key: { type: 'string' }, // client key (PEM): mTLS
      timeout: { type: 'string', default: '60' }, // seconds, per call
      json: { type: 'boolean', default: false }, // one JSON object on stdout
      help: { type: 'boolean', short: 'h', default: false },
    },
  });
  if (values.help) {
    console.log(USAGE);
    process.exit(0);
  }
  for (const name of ['max-new-tokens', 'timeout']) {
    if (!(Number(values[name]) > 0)) throw new Error(`--${name} must be a positive number`);
  }
  return values;
}

let args;
try {
  args = options();
} catch (error) {
  console.error(`${error.message}\n${USAGE}`);
  process.exit(2);
}

function connect() {
  const definition = protoLoader.loadSync(args.proto, {
    keepCase: true, // snake_case field names, as in the proto file
    longs: String, // uint64 (the seed) as a decimal string
    enums: String, // enum values by name: "MAX_TOKENS", not 1
    defaults: true, // fields left at their zero value are present in replies
    oneofs: true,
  });
  const { fmaas } = grpc.loadPackageDefinition(definition);
  const read = (file) => (file ? fs.readFileSync(file) : null);
  const credentials = args.ca
    ? grpc.credentials.createSsl(read(args.ca), read(args.key), read(args.cert))
    : grpc.credentials.createInsecure();
  return new fmaas.GenerationService(args.target, credentials);
}

const callOptions = () => ({ deadline: Date.now() + Number(args.timeout) * 1000 });

// A unary call as a promise: the reply, or the error with its gRPC status code.
function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, callOptions(), (error, reply) =>
      error ? reject(error) : resolve(reply));
  });
}

async function main() {
  const prompts = args.prompt;
  // Greedy decoding (the default method), at most --max-new-tokens new tokens per prompt.
  const params = {
    method: 'GREEDY',
    stopping: { max_new_tokens: Number(args['max-new-tokens']) },
  };
  const client = connect();
  const print = args.json ? () => {} : (line) => process.stdout.write(line);
  try {
    const info = await unary(client, 'ModelInfo', { model_id: 'default' });
    print(`model: ${info.model_kind}, max sequence length ${info.max_sequence_length}\n`);

    const batch = await unary(client, 'Generate', {
      requests: prompts.map((text) => ({ text })),
      params,
    });
    const generate = batch.responses.map((r) => ({
      text: r.text,
      input_token_count: r.input_token_count,
      generated_token_count: r.generated_token_count,
      stop_reason: r.stop_reason,
    }));
    for (const r of generate) {
      const counts = `[${r.generated_token_count} tokens, ${r.stop_reason}]`;
      print(`generate: ${JSON.stringify(r.text)} ${counts}\n`);
    }

    // A first message with the input's token count, then one per generated token: its text,
    // the running token count and the stop reason (NOT_FINISHED until the last one).
    const stream = { text: '', messages: 0, generated_token_count: 0, stop_reason: null };
    const call = client.GenerateStream({ request: { text: prompts[0] }, params }, callOptions());
    print('stream: ');
    for await (const message of call) {
      print(message.text);
      stream.text += message.text;
      stream.messages += 1;
      stream.generated_token_count = message.generated_token_count;
      stream.stop_reason = message.stop_reason;
    }
    print(`\n[${stream.generated_token_count} tokens, ${stream.stop_reason}]\n`);

    if (args.json) {
      console.log(JSON.stringify({ generate, stream, model_info: info }));
    }
  } finally {
    client.close();
  }
}

main().catch((error) => {
  const status = error.code === undefined ? null : grpc.status[error.code];
  console.error(status ? `error: ${status}: ${error.details}` : `error: ${error.message}`);
  process.exitCode = 1;
});
