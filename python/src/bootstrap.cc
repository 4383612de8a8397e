// Bootstrap bindings: ferry.Bootstrap (what AllToAll.create and friends take), CallbackBootstrap
// (an all-gather written in Python: torch.distributed, a store, MPI), and run_local_ranks (the
// embedded launcher: forked ranks joined by socketpairs, what the tests and examples use).
#include "ferry/bootstrap.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <cstdio>
#include <optional>
#include <string>

#include "binding.h"

namespace ferry::python {
namespace {

// Ranks whose all-gather is a Python callable: all_gather(data: bytes, timeout: float) ->
// sequence of world_size bytes objects, indexed by rank. Called from whichever thread runs the
// collective (it takes the GIL).
class CallbackBootstrap final : public Bootstrap {
 public:
  CallbackBootstrap(int rank, int world_size, py::function all_gather)
      : rank_(rank), world_size_(world_size), all_gather_(std::move(all_gather)) {}
  ~CallbackBootstrap() override {
    py::gil_scoped_acquire gil;
    all_gather_ = py::function();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  StatusOr<std::vector<std::vector<uint8_t>>> AllGather(std::span<const uint8_t> mine,
                                                        Millis timeout) override {
    py::gil_scoped_acquire gil;
    try {
      py::object result =
          all_gather_(py::bytes(reinterpret_cast<const char*>(mine.data()), mine.size()),
                      std::chrono::duration<double>(timeout).count());
      std::vector<std::vector<uint8_t>> all;
      for (py::handle item : result) {
        if (!PyBytes_Check(item.ptr())) {
          return InvalidArgumentError("CallbackBootstrap: all_gather must return bytes objects");
        }
        const auto* data = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(item.ptr()));
        all.emplace_back(data, data + PyBytes_GET_SIZE(item.ptr()));
      }
      if (static_cast<int>(all.size()) != world_size_) {
        return InvalidArgumentError("CallbackBootstrap: all_gather returned " +
                                    std::to_string(all.size()) + " items for " +
                                    std::to_string(world_size_) + " ranks");
      }
      return all;
    } catch (py::error_already_set& e) {
      const bool timed_out = e.matches(PyExc_TimeoutError);
      const std::string what = Summary(e);
      if (timed_out) return DeadlineExceededError("CallbackBootstrap: all_gather: " + what);
      return UnavailableError("CallbackBootstrap: all_gather raised " + what);
    }
  }

 private:
  const int rank_;
  const int world_size_;
  py::function all_gather_;
};

// Runs fn(bootstrap) in world_size forked ranks. The calling thread keeps the GIL across the
// forks (each child starts as that thread, holding it), so the caller must not have other
// threads running, as for ferry::RunLocalRanks itself.
std::vector<RankExit> RunRanks(int world_size, const py::function& fn, double timeout) {
  if (world_size < 1) ThrowIfError(InvalidArgumentError("world_size must be >= 1"));
  const Millis limit = ToMillis(timeout);
  auto body = [&fn](Bootstrap& bootstrap) -> Status {
    PyOS_AfterFork_Child();
    Status status;
    try {
      fn(py::cast(&bootstrap, py::return_value_policy::reference));
    } catch (py::error_already_set& e) {
      status = InternalError("rank " + std::to_string(bootstrap.rank()) + " raised " + Summary(e));
      e.restore();
      PyErr_Print();  // the traceback, to the child's stderr
    }
    py::module_ sys = py::module_::import("sys");
    sys.attr("stdout").attr("flush")();
    sys.attr("stderr").attr("flush")();
    return status;
  };
  return RunLocalRanks(world_size, body, limit);
}

}  // namespace

void BindBootstrap(py::module_& m) {
  py::class_<Bootstrap>(m, "Bootstrap",
                        "How ranks find each other: an all-gather of bytes and a barrier")
      .def_property_readonly("rank", &Bootstrap::rank)
      .def_property_readonly("world_size", &Bootstrap::world_size)
      .def(
          "all_gather",
          [](Bootstrap& b, const py::bytes& mine, double timeout) {
            const std::string bytes = mine;
            const Millis limit = ToMillis(timeout);
            StatusOr<std::vector<std::vector<uint8_t>>> all = [&] {
              py::gil_scoped_release release;
              return b.AllGather({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()},
                                 limit);
            }();
            py::list out;
            for (const auto& v : ValueOrThrow(std::move(all))) {
              out.append(py::bytes(reinterpret_cast<const char*>(v.data()), v.size()));
            }
            return out;
          },
          py::arg("data"), py::arg("timeout") = 30.0,
          "Every rank's bytes, indexed by rank; DeadlineExceeded after timeout seconds")
      .def(
          "barrier",
          [](Bootstrap& b, double timeout) {
            const Millis limit = ToMillis(timeout);
            Status s;
            {
              py::gil_scoped_release release;
              s = b.Barrier(limit);
            }
            ThrowIfError(s);
          },
          py::arg("timeout") = 30.0);

  py::class_<CallbackBootstrap, Bootstrap>(m, "CallbackBootstrap",
                                           "A Bootstrap whose all-gather is a Python callable")
      .def(py::init([](int rank, int world_size, py::function all_gather) {
             if (world_size < 1 || rank < 0 || rank >= world_size) {
               ThrowIfError(InvalidArgumentError("CallbackBootstrap: rank " + std::to_string(rank) +
                                                 " of world_size " + std::to_string(world_size)));
             }
             return std::make_unique<CallbackBootstrap>(rank, world_size, std::move(all_gather));
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("all_gather"));

  py::class_<RankExit>(m, "RankExit", "How one forked rank ended")
      .def_readonly("exit_code", &RankExit::exit_code)
      .def_readonly("signal", &RankExit::signal)
      .def_readonly("timed_out", &RankExit::timed_out)
      .def_property_readonly("ok", &RankExit::ok)
      .def("__repr__", [](const RankExit& r) {
        return "<ferry.RankExit exit_code=" + std::to_string(r.exit_code) +
               " signal=" + std::to_string(r.signal) + (r.timed_out ? " timed_out" : "") + ">";
      });
  m.def(
      "join_rendezvous",
      [](std::optional<std::string> address, std::optional<int> world_size,
         std::optional<int> rank, std::optional<double> timeout) {
        RendezvousOptions o = ValueOrThrow(RendezvousOptions::FromEnv());
        if (address) o.address = *address;
        if (world_size) o.world_size = *world_size;
        if (rank) o.rank = *rank;
        if (timeout) o.timeout = ToMillis(*timeout);
        StatusOr<std::unique_ptr<Bootstrap>> joined = [&] {
          py::gil_scoped_release release;
          return JoinRendezvous(o);
        }();
        return ValueOrThrow(std::move(joined));
      },
      py::arg("address") = py::none(), py::arg("world_size") = py::none(),
      py::arg("rank") = py::none(), py::arg("timeout") = py::none(),
      "Joins ranks started apart (mpirun, torchrun, Slurm, by hand) at a TCP rendezvous: rank 0 "
      "listens on address ('HOST:PORT'), the others connect, retrying until timeout seconds. "
      "Arguments left out come from FERRY_RENDEZVOUS, FERRY_WORLD_SIZE, FERRY_RANK, "
      "FERRY_RENDEZVOUS_TIMEOUT_MS. Returns the Bootstrap the other calls take.");
  m.def("run_local_ranks", &RunRanks, py::arg("world_size"), py::arg("fn"),
        py::arg("timeout") = 120.0,
        "Forks world_size ranks, each running fn(bootstrap); returns how each ended (a rank "
        "whose fn raised prints the traceback and exits 1). Call it with no other threads "
        "running.");
}

}  // namespace ferry::python
