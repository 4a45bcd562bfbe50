//! One OpenAI completion's answer: its caller's rate limits checked, its n choices opened on
//! workers, and their messages written out whole (JSON) or as they come (SSE).

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::HeaderValue;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde_json::json;

use crate::auth::Caller;
use crate::error::{openai_error_body, SidecarError};
use crate::gateway::Route;
use crate::http::{refuse, HttpState};
use crate::proto::{PredictRequest, PredictResponse};
use crate::ratelimit::Charge;
use crate::reply::{usage, Reply, Shape};
use crate::trace;

fn object(route: Route, streaming: bool) -> &'static str {
    match (route, streaming) {
        (Route::ChatCompletions, true) => "chat.completion.chunk",
        (Route::ChatCompletions, false) => "chat.completion",
        _ => "text_completion",
    }
}

/// How the reply goes out.
pub struct Options {
    pub streaming: bool,
    pub include_usage: bool,
    /// Choices: n requests to the workers, seeded seed, seed + 1, ... when the request has a seed.
    pub n: u32,
    pub caller: Caller,
}

pub async fn respond(state: &HttpState, proto: PredictRequest, shape: Shape, id: String, options: Options,
                 span: tracing::Span) -> Response {
    let route = shape.route;
    trace::record_request(&span, &proto, options.n);
    if let Some(missing) = state.gateway.pool.lacks(&proto.model, &proto) {
        return refuse(route, &proto.request_id, SidecarError::InvalidRequest(missing), &span);
    }
    let admission = match state.limits.admit(&options.caller.budget_key(&proto), &proto, options.n) {
        Ok(admission) => admission,
        Err(error) => return refuse(route, &proto.request_id, error, &span),
    };
    let mut response = answer(state, proto, shape, id, options, span, admission.charges).await;
    for (name, value) in admission.headers {
        if let Ok(value) = HeaderValue::from_str(&value) {
            response.headers_mut().insert(name, value);
        }
    }
    response
}

/// Each choice's stream carries its charge, settled when the stream ends.
async fn answer(state: &HttpState, proto: PredictRequest, shape: Shape, id: String, options: Options, span: tracing::Span,
                charges: Vec<Charge>) -> Response {
    let route = shape.route;
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let model = if proto.model.is_empty() {
        state.gateway.pool.models().into_iter().next().unwrap_or_default()
    } else {
        proto.model.clone()
    };
    let mut upstreams = Vec::new();
    for (index, charge) in (0..options.n).zip(charges) {
        let mut request = proto.clone();
        if options.n > 1 {
            request.request_id = format!("{}-{index}", proto.request_id);
            if let Some(sampling) = request.sampling.as_mut() {
                sampling.seed = sampling.seed.map(|seed| seed.wrapping_add(u64::from(index)));
            }
        }
        // Dropping those already open, on an error, cancels their calls on the workers.
        match state.gateway.open(request, state.timeout, route, &span).await {
            Ok(mut upstream) => {
                upstream.bill(charge);
                upstreams.push(upstream);
            }
            Err(error) => return error.into_response(),
        }
    }
    if !options.streaming {
        let collected = futures::future::join_all(upstreams.into_iter().enumerate().map(|(index, mut upstream)| async move {
            let mut reply = Reply::new(index as u32);
            while let Some(item) = upstream.next().await {
                reply.absorb(item?);
            }
            Ok::<_, SidecarError>(reply)
        }))
        .await;
        let replies = match collected.into_iter().collect::<Result<Vec<_>, _>>() {
            Ok(replies) => replies,
            Err(error) => return error.into_response(),
        };
        return Json(json!({
            "id": id, "object": object(route, false), "created": created, "model": model,
            "choices": replies.iter().map(|r| r.whole(&shape)).collect::<Vec<_>>(),
            "usage": usage(&replies),
        }))
        .into_response();
    }
    // Dropped when the client disconnects, which drops every upstream and cancels the workers' calls.
    let mut merged = futures::stream::select_all(upstreams.into_iter().enumerate().map(|(index, upstream)| {
        Box::pin(futures::stream::unfold(upstream, |mut upstream| async move {
            upstream.next().await.map(|item| (item, upstream))
        }).map(move |item| (index, item)))
    }));
    let events = async_stream::stream! {
        let mut replies: Vec<Reply> = (0..options.n).map(Reply::new).collect();
        while let Some((index, item)) = merged.next().await {
            match item {
                Ok(message) => {
                    let message: PredictResponse = message;
                    if let Some(choice) = replies[index].delta(&shape, message) {
                        let chunk = json!({"id": id, "object": object(route, true), "created": created, "model": model,
                                           "choices": [choice]});
                        yield Ok::<_, Infallible>(Event::default().data(chunk.to_string()));
                    }
                }
                Err(error) => {
                    yield Ok(Event::default().data(openai_error_body(error.http_status(), &error.to_string()).to_string()));
                    return;
                }
            }
        }
        if options.include_usage {
            let chunk = json!({"id": id, "object": object(route, true), "created": created, "model": model,
                               "choices": [], "usage": usage(&replies)});
            yield Ok(Event::default().data(chunk.to_string()));
        }
        yield Ok(Event::default().data("[DONE]"));
    };
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}
