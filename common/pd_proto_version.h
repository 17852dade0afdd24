/* pd_proto_version.h - the wire protocol version and its check.
 * Owns: PD_PROTO_VERSION (bump on any incompatible change to proto/pdspark.proto) and
 *       pd_proto_version_check(), which every receiver applies to each top-level message.
 * Not here: the messages themselves (proto/pdspark.proto, generated into the build tree).
 *       pd_rpc applies the check to every request before a handler sees it; clients call it
 *       on replies they care about.
 * Threading: pure functions. */
#ifndef PD_PROTO_VERSION_H
#define PD_PROTO_VERSION_H

#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include "pd_status.h"

#define PD_PROTO_VERSION 1u

/* Field number of `uint32 version` in every pdspark message. */
#define PD_PROTO_VERSION_FIELD 1u

/* Read the version field of any pdspark message (field 1, uint32). Returns 0 when the message
 * type has no such field (or msg is NULL). */
static inline uint32_t pd_proto_version_of(const ProtobufCMessage *msg)
{
    if (msg == NULL)
        return 0;
    const ProtobufCFieldDescriptor *f =
        protobuf_c_message_descriptor_get_field(msg->descriptor, PD_PROTO_VERSION_FIELD);
    if (f == NULL || f->type != PROTOBUF_C_TYPE_UINT32 || f->label == PROTOBUF_C_LABEL_REPEATED)
        return 0;
    return *(const uint32_t *)(const void *)((const char *)msg + f->offset);
}

/* PD_OK when msg carries PD_PROTO_VERSION; PD_ERR_INVALID (with "<type>: protocol version N,
 * expected M" in err) otherwise. A missing version (0, the proto3 default) is a mismatch. */
static inline pd_status pd_proto_version_check(const ProtobufCMessage *msg, pd_err *err)
{
    if (msg == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "no message");
    uint32_t v = pd_proto_version_of(msg);
    if (v != PD_PROTO_VERSION)
        return pd_err_set(err, PD_ERR_INVALID, "%s: protocol version %u, expected %u%s",
                          msg->descriptor->name, v, PD_PROTO_VERSION,
                          v == 0 ? " (version field not set)" : "");
    return PD_OK;
}

#endif
