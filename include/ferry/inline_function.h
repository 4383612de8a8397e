// InlineFunction: a move-only callable stored in a fixed inline buffer.
//
// Completion callbacks travel through the engine's submission queue and sit in its transfer slots;
// std::function would allocate for any capture larger than two pointers. InlineFunction never
// allocates: a capture that does not fit is a compile-time error, not a hidden malloc on the
// post path.
#pragma once

#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>

namespace ferry {

template <typename Signature, size_t kCapacity = 48>
class InlineFunction;

template <typename R, typename... Args, size_t kCapacity>
class InlineFunction<R(Args...), kCapacity> {
 public:
  InlineFunction() = default;
  InlineFunction(std::nullptr_t) {}  // NOLINT: implicit, like std::function

  template <typename F, typename = std::enable_if_t<
                            !std::is_same_v<std::decay_t<F>, InlineFunction> &&
                            std::is_invocable_r_v<R, std::decay_t<F>&, Args...>>>
  InlineFunction(F&& f) {  // NOLINT: implicit, like std::function
    using Fn = std::decay_t<F>;
    static_assert(sizeof(Fn) <= kCapacity,
                  "callback capture too large for InlineFunction: capture a pointer instead");
    static_assert(alignof(Fn) <= alignof(std::max_align_t), "over-aligned callback capture");
    static_assert(std::is_nothrow_move_constructible_v<Fn>, "callback must be nothrow-movable");
    new (storage_) Fn(std::forward<F>(f));
    ops_ = &kOpsFor<Fn>;
  }

  InlineFunction(InlineFunction&& other) noexcept { MoveFrom(other); }
  InlineFunction& operator=(InlineFunction&& other) noexcept {
    if (this != &other) {
      Reset();
      MoveFrom(other);
    }
    return *this;
  }
  InlineFunction(const InlineFunction&) = delete;
  InlineFunction& operator=(const InlineFunction&) = delete;
  ~InlineFunction() { Reset(); }

  explicit operator bool() const { return ops_ != nullptr; }

  R operator()(Args... args) { return ops_->invoke(storage_, std::forward<Args>(args)...); }

  void Reset() {
    if (ops_) ops_->destroy(storage_);
    ops_ = nullptr;
  }

 private:
  struct Ops {
    R (*invoke)(void*, Args&&...);
    void (*move)(void* dst, void* src);  // move-constructs into dst, destroys src
    void (*destroy)(void*);
  };

  template <typename Fn>
  static constexpr Ops kOpsFor = {
      [](void* p, Args&&... args) -> R {
        return (*static_cast<Fn*>(p))(std::forward<Args>(args)...);
      },
      [](void* dst, void* src) {
        new (dst) Fn(std::move(*static_cast<Fn*>(src)));
        static_cast<Fn*>(src)->~Fn();
      },
      [](void* p) { static_cast<Fn*>(p)->~Fn(); },
  };

  void MoveFrom(InlineFunction& other) {
    if (other.ops_) {
      other.ops_->move(storage_, other.storage_);
      ops_ = other.ops_;
      other.ops_ = nullptr;
    }
  }

  alignas(std::max_align_t) unsigned char storage_[kCapacity];
  const Ops* ops_ = nullptr;
};

}  // namespace ferry
