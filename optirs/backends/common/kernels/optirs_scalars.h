/* The per-step scalar records of optirs.core.scalars, as OpenCL C structs passed by value.
 *
 * Field order and types mirror the Python NamedTuples exactly (float32 -> float, bool -> int);
 * the host builds a numpy record with the same layout and checks sizeof() of every struct
 * against it when the program is built (kernel optirs_struct_sizes), so a field added on one
 * side only fails loudly instead of shifting every value. Every record ends with grad_factor,
 * which the element math multiplies each gradient element by first (maximize, unscale).
 */
#ifndef OPTIRS_SCALARS_H
#define OPTIRS_SCALARS_H

typedef struct {
    float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
    float step_size;             /* lr / (1 - beta1^t) */
    float bias_correction2_sqrt; /* sqrt(1 - beta2^t) */
    float decay_factor;          /* 1 - lr * weight_decay (AdamW) */
    int decoupled, amsgrad;
    float grad_factor;           /* every gradient element is multiplied by it first */
} adam_scalars;

typedef struct {
    float lr, momentum, dampening_factor, weight_decay;
    int nesterov, has_momentum, first_step;
    float grad_factor;           /* every gradient element is multiplied by it first */
} sgd_scalars;

typedef struct {
    float lr, alpha, one_minus_alpha, eps, weight_decay, momentum;
    int centered, has_momentum;
    float grad_factor;           /* every gradient element is multiplied by it first */
} rmsprop_scalars;

typedef struct {
    float clr, weight_decay, eps;
    float grad_factor;           /* every gradient element is multiplied by it first */
} adagrad_scalars;

typedef struct {
    float lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
    float bias_correction1, bias_correction2, max_trust_ratio, max_grad_norm;
    float grad_factor;           /* every gradient element is multiplied by it first */
} lamb_scalars;

/* Appended optimizers (their sizes are checked by optirs_struct_sizes_appended). */
typedef struct {
    float lr, beta1, one_minus_beta1, beta2, one_minus_beta2;
    float decay_factor; /* 1 - lr * weight_decay */
    float grad_factor;           /* every gradient element is multiplied by it first */
} lion_scalars;

typedef struct {
    float beta2_weight;  /* step^beta2_decay, the new mean's weight in the running means */
    float rho;           /* min(lr, 1 / sqrt(step)) */
    float eps1, eps1_squared, eps2, d;
    float decay_factor;  /* 1 - lr * weight_decay */
    int maximize;
    float grad_factor;           /* every gradient element is multiplied by it first */
} adafactor_scalars;

/* NAdam, RAdam, Adamax, Adadelta, ASGD, Rprop (optirs.core.scalars; host-computed records). */
typedef struct {
    float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
    float bias_correction2;      /* 1 - beta2^t */
    float grad_coef, avg_coef;   /* -lr (1 - mu_t) / (1 - P_t), -lr mu_{t+1} / (1 - P_{t+1}) */
    float decay_factor;          /* 1 - lr * weight_decay (decoupled) */
    int decoupled;
    float grad_factor;           /* every gradient element is multiplied by it first */
} nadam_scalars;

typedef struct {
    float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, lr;
    float bias_correction1, bias_correction2_sqrt, rect;
    float decay_factor;          /* 1 - lr * weight_decay (decoupled) */
    int rectified, decoupled;
    float grad_factor;           /* every gradient element is multiplied by it first */
} radam_scalars;

typedef struct {
    float beta1, one_minus_beta1, beta2, eps, weight_decay;
    float clr;                   /* lr / (1 - beta1^t) */
    float grad_factor;           /* every gradient element is multiplied by it first */
} adamax_scalars;

typedef struct {
    float lr, rho, one_minus_rho, eps, weight_decay;
    float grad_factor;           /* every gradient element is multiplied by it first */
} adadelta_scalars;

typedef struct {
    float eta, decay_factor, weight_decay, mu;
    int averaging;               /* mu != 1 (else ax = p) */
    float grad_factor;           /* every gradient element is multiplied by it first */
} asgd_scalars;

typedef struct {
    float lr;                    /* the step sizes' start (first step) */
    float etaminus, etaplus, step_size_min, step_size_max;
    int first_step;
    float grad_factor;           /* every gradient element is multiplied by it first */
} rprop_scalars;

#endif
