/* pd_engine_sps.h - the engine's steps-per-second profile (pd_engine_sps.c): the target's
 *   verify step timed on this device, the curve the scheduled policy plans with.
 * The functions are public: pd_engine_profile_sps and pd_engine_profile_sps_cached in
 *   pd_engine.h; this header only names the module (nothing else of it is shared).
 * Not here: the curve's smoothing, its file format and lookups (pd_verify_policy.c).
 * Threading: the engine's thread only. */
#ifndef PD_ENGINE_SPS_H
#define PD_ENGINE_SPS_H

#include "pd_engine.h"

#endif
