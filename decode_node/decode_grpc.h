/* decode_grpc.h - the decode node's public gRPC service (pdspark.Generate: Generate, Health).
 * Owns: the pd_rpc server and the mapping between GenerateRequest/GenerateChunk and
 *   decode_api.h (validation messages come from decode_submit).
 * Not here: request scheduling (decode_server.c).
 * Threading: create/destroy on the main thread; handlers run on pd_rpc's poller thread,
 *   the token/done callbacks on the engine thread. */
#ifndef DECODE_GRPC_H
#define DECODE_GRPC_H

#include "decode_api.h"
#include "pd_rpc.h"

/* Serve Generate + Health for s (borrowed; must outlive the server) on addr ("HOST:PORT",
 * port 0 = any). Errors: as pd_rpc_server_create. */
pd_status decode_grpc_start(decode_server *s, const char *addr, pd_rpc_server **out, pd_err *err);

#endif
