// What both devices' AllToAll check before a step runs: the order of the steps, and the caller's
// buffers and their forms. (What only one device can check -- expert ids in host memory, device
// pointers' alignment -- each checks after these.)
#pragma once

#include "ferry/bootstrap.h"
#include "ferry/fabric.h"
#include "ferry/moe.h"

namespace ferry::moe {

// Where an AllToAll is in its epoch: the step that may run next.
enum class Stage { kIdle, kDispatchSent, kDispatchDone, kCombineSent };

// FailedPrecondition naming the order unless the AllToAll is at `want` (`step`: the one called).
Status CheckStage(Stage at, Stage want, const char* step);
// DispatchInput: indices or indices64, not both; x_bf16 only on an fp8 configuration and in
// place of x and scales; a token count within the configured maximum; every buffer the count
// needs.
Status CheckDispatchInput(const AllToAllConfig& c, const DispatchInput& in);
// InvalidArgument when `out` lacks a buffer the configuration's layout fills, or has one it
// does not (a caller mixing up the layouts).
Status CheckDispatchOutput(const AllToAllConfig& c, const DispatchOutput& out);
// CombineInput: expert outputs given; fp16 only where the combine's rows are 2 bytes.
Status CheckCombineInput(const AllToAllConfig& c, const CombineInput& in);
// InvalidArgument for combine-time weights where the expert ranks summed with the dispatch's
// (combine_reduce_at_expert_rank), and for fp16 where the combine is fp32 or the CombineSend
// was told otherwise (`sent_fp16`: its CombineInput::fp16).
Status CheckCombineOutput(const AllToAllConfig& c, const CombineOutput& out, bool sent_fp16);
// AllToAll::SetMasked's checks (`now`: whether `rank` is masked already): InvalidArgument for a
// rank out of range or ourselves, Unimplemented for unmasking a masked rank; else OK, with
// *change true when the rank is to be masked now.
Status CheckSetMasked(const AllToAllConfig& c, int rank, bool masked, bool now, bool* change);
// InvalidArgument unless the bootstrap (Create's, or Readmit's and Join's group) holds the
// configuration's world, this rank at its id.
Status CheckMembershipGroup(const AllToAllConfig& c, const Bootstrap& group);
// The configuration as it runs (config() reports it: forwarding resolved), after the checks
// AllToAll::Create, Join and Resize share: valid, an engine where one is needed, the bootstrap
// holding its world (CheckMembershipGroup).
StatusOr<AllToAllConfig> Resolve(const AllToAllConfig& asked, TransferEngine* engine,
                                 const Bootstrap& bootstrap);

}  // namespace ferry::moe
